"""Train the EAGLE-3 draft (speculators' Eagle3DraftModel) on hidden-state shards, resumably.

Data (`eyrie.packing`): every sample of every shard, aligned for EAGLE-3 (`shift_sample`) and
packed into batches of at most `max_tokens_per_batch` tokens (`document_ids` keep samples apart;
-1 is padding), in an order shuffled per epoch by a seeded generator. The whole plan (every
epoch's batches) is a function of the settings and the shards, so a position (epoch, batch)
identifies the data exactly and a resumed run sees the same batches as an uninterrupted one.

State: `--state-dir/<run id>/step_<N>/` (model safetensors, optimizer + scheduler + RNG states,
data position), written atomically every `checkpoint_every` steps and at the end; the run id
hashes the settings that change the weights and the identity of every input file. A run
restarts from the latest checkpoint of its run id.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from eyrie import EyrieError
from eyrie.io import atomic_path, provenance, write_json
from eyrie.preflight import read_report
from eyrie.vocab import read_vocab
from eyrie.packing import PackedShards, epoch_order, pack
from eyrie.targets import fingerprint, read_config, tokenizer_hash

log = logging.getLogger(__name__)

# Settings that do not change the trained weights (left out of the run id).
NOT_IN_RUN_ID = ("log_every", "checkpoint_every")
KEEP_CHECKPOINTS = 2
KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True)
class TrainSettings:
    seed: int = 0
    device: str = "auto"
    epochs: int = 6
    learning_rate: float = 3.0e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_grad_norm: float = 1.0
    max_tokens_per_batch: int = 2048
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    num_layers: int = 1
    draft_arch: str = "llama"
    norm_before_residual: bool = True
    checkpoint_every: int = 100
    log_every: int = 10

    @classmethod
    def from_settings(cls, settings: dict) -> "TrainSettings":
        """Typed `train` section of --settings; every problem reported at once, each by key."""
        section = settings.get("train")
        if not isinstance(section, dict):
            raise EyrieError('--settings: missing object "train" (pass {"train": {...}} from config.yaml)')
        fields = {f.name: f for f in dataclasses.fields(cls)}
        problems = [f"train.{k}: unknown key (allowed: {', '.join(fields)})"
                    for k in section if k not in fields]
        for name, value in section.items():
            if name not in fields:
                continue
            kind = type(fields[name].default)
            ok = isinstance(value, bool) if kind is bool else (
                isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
                else isinstance(value, kind) and not isinstance(value, bool))
            if not ok:
                problems.append(f"train.{name}: {value!r} must be {KIND_NAMES[kind]}")
        if not problems:
            cfg = cls(**{k: (float(v) if type(fields[k].default) is float else v)
                         for k, v in section.items()})
            rules = [
                (cfg.device in ("auto", "cpu", "cuda"), "device: use auto, cpu or cuda"),
                (cfg.draft_arch in ("llama", "qwen3"), "draft_arch: use llama or qwen3"),
                (cfg.ttt_steps >= 1, "ttt_steps: must be >= 1"),
                (cfg.epochs >= 1, "epochs: must be >= 1"),
                (cfg.num_layers >= 1, "num_layers: must be >= 1"),
                (cfg.learning_rate > 0, "learning_rate: must be > 0"),
                (cfg.max_grad_norm > 0, "max_grad_norm: must be > 0"),
                (cfg.ttt_step_loss_decay > 0, "ttt_step_loss_decay: must be > 0"),
                (cfg.warmup_steps >= 0 and cfg.weight_decay >= 0, "warmup_steps/weight_decay: must be >= 0"),
                (cfg.checkpoint_every >= 1 and cfg.log_every >= 1, "checkpoint_every/log_every: must be >= 1"),
                (cfg.max_tokens_per_batch >= 8 * cfg.ttt_steps,
                 f"max_tokens_per_batch: {cfg.max_tokens_per_batch} is too small for ttt_steps="
                 f"{cfg.ttt_steps} (use at least {8 * cfg.ttt_steps})"),
            ]
            problems += [f"train.{msg}" for ok, msg in rules if not ok]
        if problems:
            raise EyrieError("invalid train settings: " + "; ".join(problems))
        return cfg


# ---------------------------------------------------------------- inputs

def _expectation(preflight_path: Path) -> dict:
    report = read_report(preflight_path)
    target = report.get("target") or {}
    expect = {
        "target_fingerprint": target.get("fingerprint"),
        "tokenizer_hash": target.get("tokenizer_hash"),
        "aux_layer_ids": report.get("aux_layer_ids"),
        "final_layer_id": report.get("final_layer_id"),
        "hidden_size": target.get("hidden_size"),
    }
    names = {"target_fingerprint": "target.fingerprint", "tokenizer_hash": "target.tokenizer_hash",
             "hidden_size": "target.hidden_size"}
    for key, value in expect.items():
        if value is None:
            raise EyrieError(f"{preflight_path}: key {names.get(key, key)} missing; rerun eyrie preflight")
    return expect


# ---------------------------------------------------------------- run identity and checkpoints

def _file_identity(path: Path, content: bool) -> dict:
    st = path.stat()
    ident = {"name": path.name, "size": st.st_size}
    if content:
        ident["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    else:  # large files: name, size and modification time
        ident["mtime_ns"] = st.st_mtime_ns
    return ident


def run_id(cfg: TrainSettings, target: Path, preflight: Path, vocab: Path, shards: list[Path]) -> str:
    weights = sorted(p for p in target.iterdir() if p.suffix == ".safetensors")
    ident = {
        "settings": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IN_RUN_ID},
        "target_config": fingerprint(read_config(target)),
        "target_weights": [_file_identity(p, content=False) for p in weights],
        "preflight": _file_identity(preflight, content=True),
        "vocab": _file_identity(vocab, content=True),
        "shards": [_file_identity(p, content=False) for p in shards],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _rng_state() -> dict:
    version, state, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": {"version": version, "state": torch.tensor(state, dtype=torch.int64), "gauss": gauss},
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
    }


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    p = s["python"]
    random.setstate((p["version"], tuple(p["state"].tolist()), p["gauss"]))
    n = s["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))


def save_checkpoint(run_dir: Path, model, optimizer, scheduler, position: dict) -> Path:
    """Atomically write run_dir/step_<N>/ and keep the newest KEEP_CHECKPOINTS."""
    from safetensors.torch import save_file
    final = run_dir / f"step_{position['step']:08d}"
    with atomic_path(final) as tmp:
        tmp.mkdir()
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                  str(tmp / "model.safetensors"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": _rng_state()}, tmp / "state.pt")
        (tmp / "position.json").write_text(json.dumps(position, indent=2, sort_keys=True))
    for old in sorted(run_dir.glob("step_*"))[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """Newest complete checkpoint (folders only appear complete: they are renamed into place)."""
    done = sorted(p for p in run_dir.glob("step_*") if (p / "position.json").is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict:
    from safetensors.torch import load_file
    device = next(model.parameters()).device
    model.load_state_dict(load_file(str(path / "model.safetensors"), device=str(device)), strict=True)
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return json.loads((path / "position.json").read_text())


# ---------------------------------------------------------------- training

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise EyrieError("train.device is cuda but no CUDA device is visible; use auto or cpu")
    return torch.device(name)


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _step_metrics(metrics: dict, ttt_steps: int) -> dict:
    out = {}
    for k in range(ttt_steps):
        total = float(metrics[f"full_acc_{k}_total"])
        out[f"full_acc_{k}"] = float(metrics[f"full_acc_{k}_sum"]) / total if total else None
        out[f"loss_{k}"] = float(metrics[f"loss_{k}_sum"])
    return out


def train(target: Path, preflight: Path, vocab: Path, shards: list[Path], out_dir: Path,
          state_dir: Path, settings: dict, *, stop_after_steps: int | None = None,
          on_step: Callable[[int], None] | None = None) -> dict | None:
    """Train (resuming when a checkpoint of the same run exists) and write `out_dir`.

    `stop_after_steps`: checkpoint and return None once that many steps are done (a planned
    preemption; the next call resumes). `on_step(step)` is called after each step.
    Returns the train.json summary when training finished.
    """
    from speculators.losses import resolve_loss_config
    from eyrie.draft import build_draft

    cfg = TrainSettings.from_settings(settings)
    target, preflight, vocab = Path(target).resolve(), Path(preflight), Path(vocab)
    shards, out_dir, state_dir = [Path(s) for s in shards], Path(out_dir), Path(state_dir)
    if state_dir.resolve().is_relative_to(out_dir.resolve()):
        raise EyrieError(f"--state-dir {state_dir} is inside --out-dir {out_dir}; keep them apart "
                         "(the output folder is replaced as a whole)")
    expect = _expectation(preflight)
    for key, have in (("fingerprint", fingerprint(read_config(target))),
                      ("tokenizer_hash", tokenizer_hash(target))):
        want = expect["target_fingerprint" if key == "fingerprint" else key]
        if have != want:
            raise EyrieError(f"{preflight}: target.{key} is {want} but {target} has {have}; "
                             "rerun eyrie preflight for this target")
    gap = cfg.ttt_steps - 1
    data = PackedShards(shards, expect, cfg.max_tokens_per_batch, gap)
    d2t, t2d = read_vocab(vocab)
    plan = [pack(data.lengths, epoch_order(len(data), cfg.seed, e), cfg.max_tokens_per_batch, gap)
            for e in range(cfg.epochs)]
    total_steps = sum(len(p) for p in plan)
    rid = run_id(cfg, target, preflight, vocab, shards)
    run_dir = state_dir / rid
    run_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    log.info("%d samples (%d skipped without loss tokens, %d truncated to %d tokens) from %d shards; "
             "%d steps over %d epochs; run %s on %s", len(data), data.skipped, data.truncated,
             cfg.max_tokens_per_batch - gap, len(shards), total_steps, cfg.epochs, rid, device)

    model = build_draft(target, expect["aux_layer_ids"], d2t, t2d, num_layers=cfg.num_layers,
                        draft_arch=cfg.draft_arch, norm_before_residual=cfg.norm_before_residual,
                        ttt_steps=cfg.ttt_steps, seed=cfg.seed).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, total_steps))
    loss_config = resolve_loss_config("kl_div", "eager")

    metrics_path = run_dir / "metrics.jsonl"
    position = {"step": 0, "epoch": 0, "batch": 0, "tokens": 0, "wall_s": 0.0, "run_id": rid}
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        position = load_checkpoint(ckpt, model, optimizer, scheduler)
        log.info("resumed from %s (step %d, epoch %d, batch %d)", ckpt, position["step"],
                 position["epoch"], position["batch"])
        lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
        with atomic_path(metrics_path) as tmp:  # drop steps done after the checkpoint
            tmp.write_text("".join(f"{ln}\n" for ln in lines if json.loads(ln)["step"] <= position["step"]))
    else:
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        metrics_path.unlink(missing_ok=True)
    resumed_from = position["step"]

    started = time.monotonic()
    wall0 = position["wall_s"]
    window: list[dict] = []
    with metrics_path.open("a") as metrics_file:
        while position["epoch"] < cfg.epochs:
            batches = plan[position["epoch"]]
            if position["batch"] >= len(batches):
                position.update(epoch=position["epoch"] + 1, batch=0)
                continue
            batch = {k: v.to(device) for k, v in data.batch(batches[position["batch"]]).items()}
            _, loss, metrics = model(**batch, ttt_steps=cfg.ttt_steps,
                                     ttt_step_loss_decay=cfg.ttt_step_loss_decay, loss_config=loss_config)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            tokens = int((batch["document_ids"] >= 0).sum())
            position.update(step=position["step"] + 1, batch=position["batch"] + 1,
                            tokens=position["tokens"] + tokens,
                            wall_s=wall0 + time.monotonic() - started)
            record = {"step": position["step"], "epoch": position["epoch"], "loss": float(loss.detach()),
                      "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                      "tokens": tokens, "loss_tokens": int(batch["loss_mask"].sum()),
                      **_step_metrics(metrics, cfg.ttt_steps)}
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            window = (window + [record])[-cfg.log_every:]
            step = position["step"]
            if step % cfg.log_every == 0 or step == total_steps:
                accs = " ".join(f"acc{k}={_fmt(_mean(window, f'full_acc_{k}'))}" for k in range(cfg.ttt_steps))
                log.info("step %d/%d epoch %d loss %s %s lr %.2e %.0f tok/s", step, total_steps,
                         position["epoch"], _fmt(_mean(window, "loss")), accs, record["lr"],
                         position["tokens"] / max(position["wall_s"], 1e-9))
            stopping = stop_after_steps is not None and step >= stop_after_steps and step < total_steps
            if step % cfg.checkpoint_every == 0 or step == total_steps or stopping:
                save_checkpoint(run_dir, model, optimizer, scheduler, position)
            if on_step is not None:
                on_step(step)
            if stopping:
                log.info("stopping after step %d as asked; rerun to resume", step)
                data.close()
                return None
    data.close()

    records = [json.loads(ln) for ln in metrics_path.read_text().splitlines()]
    last = records[-cfg.log_every:]
    summary = {
        "steps": total_steps, "epochs": cfg.epochs, "samples": len(data),
        "skipped_samples": data.skipped, "truncated_samples": data.truncated,
        "tokens": position["tokens"],
        "final": {"loss": _mean(last, "loss"),
                  "full_acc": [_mean(last, f"full_acc_{k}") for k in range(cfg.ttt_steps)],
                  "over_last_steps": len(last)},
        "wall_time_s": position["wall_s"],
        "tokens_per_s": position["tokens"] / max(position["wall_s"], 1e-9),
        "resumed_from_step": resumed_from, "run_id": rid, "device": str(device),
        "target": {"path": str(target), "fingerprint": expect["target_fingerprint"],
                   "tokenizer_hash": expect["tokenizer_hash"], "hidden_size": expect["hidden_size"]},
        "aux_layer_ids": expect["aux_layer_ids"], "final_layer_id": expect["final_layer_id"],
        "inputs": {"preflight": str(preflight), "vocab": str(vocab), "shards": [str(s) for s in shards]},
        "provenance": provenance(settings),
    }
    write_outputs(out_dir, model, records, summary, cfg.ttt_steps)
    log.info("wrote %s: final loss %s, accuracy per TTT step %s", out_dir,
             _fmt(summary["final"]["loss"]), [_fmt(a) for a in summary["final"]["full_acc"]])
    return summary


def write_outputs(out_dir: Path, model, records: list[dict], summary: dict, ttt_steps: int) -> None:
    """out_dir/{draft/, metrics.jsonl, curves.png, train.json}, replaced as a whole."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        model.to("cpu").save_pretrained(tmp / "draft")
        (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        plot_curves(records, ttt_steps, tmp / "curves.png")
        write_json(tmp / "train.json", summary)


def _mean(records: list[dict], key: str) -> float | None:
    """Mean of `key` over records that have it (accuracy is None for a step without targets)."""
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def plot_curves(records: list[dict], ttt_steps: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in records], lw=1)
    ax_loss.set(xlabel="step", ylabel="loss (sum over TTT steps)", title="training loss")
    for k in range(ttt_steps):
        pts = [(r["step"], r[f"full_acc_{k}"]) for r in records if r.get(f"full_acc_{k}") is not None]
        ax_acc.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, label=f"TTT step {k}")
    ax_acc.set(xlabel="step", ylabel="accuracy (all previous steps correct)", ylim=(0, 1),
               title="draft accuracy vs target argmax")
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eyrie.cli import settings_arg
    parser.add_argument("--target", required=True, type=Path, help="target model folder")
    parser.add_argument("--preflight", required=True, type=Path, help="preflight.json")
    parser.add_argument("--vocab", required=True, type=Path, help="vocab.safetensors (d2t, t2d)")
    parser.add_argument("--shards", required=True, nargs="+", type=Path, help="hidden-state HDF5 shards")
    parser.add_argument("--out-dir", required=True, type=Path, help="results/<name>/train")
    parser.add_argument("--state-dir", required=True, type=Path, help="results/<name>/train_state")
    parser.add_argument("--settings", required=True, type=settings_arg, help='{"train": {...}}')
    # Planned preemption: checkpoint after this many steps and exit (the next run resumes).
    parser.add_argument("--stop-after-steps", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    summary = train(args.target, args.preflight, args.vocab, args.shards, args.out_dir,
                    args.state_dir, args.settings, stop_after_steps=args.stop_after_steps)
    return 0 if summary is not None else 3
