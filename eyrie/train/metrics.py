"""Training metrics and outputs: the step records of metrics.jsonl (from the packs' device-side
sums, eyrie.train.kinds), the means the progress line prints, and the output folder (draft,
metrics.jsonl, curves.png, tensorboard/, train.json).

Contract: a step's record holds its loss (the mean over its packs), per-TTT-step losses and full
accuracies, token counts, lr, grad norm, data wait and wall time, from the sums of every rank's
packs. Outputs and metrics: docs/training.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from eyrie.config.sections import TrainSettings
from eyrie.core.io import atomic_path, write_json
from eyrie.train.curves import TENSORBOARD_DIR, write_event_files


def read_pending(
    pending: list[tuple[dict, torch.Tensor, torch.Tensor]], packs: int, positions: int
) -> list[dict]:
    """The metrics records of steps whose device values were not read yet (one wait)."""
    sums = torch.stack([s for _, s, _ in pending]).tolist()
    norms = torch.stack([g.detach().float() for _, _, g in pending]).tolist()
    records = []
    for (head, _, _), v, norm in zip(pending, sums, norms):
        tokens, loss_tokens = head["tokens"]
        records.append(
            {
                "step": head["step"],
                "epoch": head["epoch"],
                **_step_record([v[0], tokens, loss_tokens, *v[1:]], packs, positions),
                "lr": head["lr"],
                "grad_norm": norm,
                "data_wait_s": head["data_wait_s"],
                "wall_s": head["wall_s"],
            }
        )
    return records


def _step_record(sums: list[float], packs: int, positions: int) -> dict:
    """A step's metrics from the sums of its packs over all ranks (loss: mean over packs)."""
    K = positions
    out = {"loss": sums[0] / packs, "tokens": int(sums[1]), "loss_tokens": int(sums[2])}
    for k in range(K):
        total = sums[3 + 2 * K + k]
        out[f"full_acc_{k}"] = sums[3 + K + k] / total if total else None
        loss_k = sums[3 + k]  # NaN: a kind without per-position losses (eyrie.train.kinds)
        out[f"loss_{k}"] = None if math.isnan(loss_k) else loss_k / packs
    return out


def write_outputs(
    out_dir: Path,
    model,
    records: list[dict],
    summary: dict,
    cfg: TrainSettings,
    weights: dict | None = None,
) -> None:
    """out_dir/{draft/, metrics.jsonl, curves.png, tensorboard/ (with train.report_to's
    tensorboard), train.json}, replaced as a whole. `weights`: a sharded draft's state_dict
    gathered whole (eyrie.train.sharding.full_states), written for it."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        if weights is None:
            model.to("cpu").save_pretrained(tmp / "draft")
        else:
            model.save_pretrained(tmp / "draft", state_dict=weights)
        (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        plot_curves(records, cfg.positions, tmp / "curves.png")
        if "tensorboard" in cfg.report_to:
            write_event_files(tmp / TENSORBOARD_DIR, records, cfg.positions, cfg.log_every)
        write_json(tmp / "train.json", summary)


def mean(records: list[dict], key: str) -> float | None:
    """Mean of `key` over records that have it (accuracy is None for a step without targets)."""
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def plot_curves(records: list[dict], positions: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in records], lw=1)
    ax_loss.set(xlabel="step", ylabel="loss (sum over TTT steps)", title="training loss")
    for k in range(positions):
        pts = [
            (r["step"], r[f"full_acc_{k}"]) for r in records if r.get(f"full_acc_{k}") is not None
        ]
        ax_acc.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, label=f"drafted token {k}")
    ax_acc.set(
        xlabel="step",
        ylabel="accuracy (all previous steps correct)",
        ylim=(0, 1),
        title="draft accuracy vs target argmax",
    )
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
