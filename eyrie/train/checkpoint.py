"""A training run's resumable state: its run id, its step checkpoints and its metrics file.

Contract: `--state-dir/<run id>/step_<N>/` holds model.safetensors, state.pt (optimizer, scheduler
and RNG states) and position.json; a folder appears only complete (renamed into place), and
loading one restores every RNG to where the saving run was. The run id hashes the settings that
change the weights and the identity of every input file. Layout and semantics: docs/training.md
("Resume").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from eyrie.arch.target import fingerprint, read_config
from eyrie.formats.report import identity, read_report
from eyrie.io import atomic_path
from eyrie.store.fingerprint import file_digest
from eyrie.train.config import NOT_IN_RUN_ID, TrainSettings

log = logging.getLogger(__name__)


KEEP_CHECKPOINTS = 2


def _file_identity(path: Path) -> dict:
    """Name, size and content (whole for a small file, sampled for a large one): a shard the
    output store restored, with a new mtime, is the same input."""
    size = path.stat().st_size
    return {"name": path.name, "size": size, "digest": file_digest(path, size)}


def run_id(
    cfg: TrainSettings, target: Path, preflight: Path, vocab: Path, shards: list[Path]
) -> str:
    """16 hex digits naming the run: what changes the weights, never the number of processes."""
    ident = {
        "settings": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IN_RUN_ID},
        "target_config": fingerprint(read_config(target)),
        # what in the report determines the weights, not its time or host: a preflight rerun
        # with the same outcome keeps the run (and its checkpoints)
        "preflight": identity(read_report(preflight)),
        "vocab": _file_identity(vocab),
        "shards": [_file_identity(p) for p in shards],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _rng_state() -> dict:
    version, state, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": {
            "version": version,
            "state": torch.tensor(state, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
    }


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    p = s["python"]
    random.setstate((p["version"], tuple(p["state"].tolist()), p["gauss"]))
    n = s["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )


def save_checkpoint(run_dir: Path, model, optimizer, scheduler, position: dict) -> Path:
    """Atomically write run_dir/step_<N>/ and keep the newest KEEP_CHECKPOINTS."""
    from safetensors.torch import save_file

    final = run_dir / f"step_{position['step']:08d}"
    with atomic_path(final) as tmp:
        tmp.mkdir()
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
            str(tmp / "model.safetensors"),
        )
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": _rng_state(),
            },
            tmp / "state.pt",
        )
        (tmp / "position.json").write_text(json.dumps(position, indent=2, sort_keys=True))
    for old in sorted(run_dir.glob("step_*"))[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """Newest complete checkpoint (folders only appear complete: they are renamed into place)."""
    done = sorted(p for p in run_dir.glob("step_*") if (p / "position.json").is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict:
    """Restore the weights, optimizer, scheduler and RNG states of `path`; its position."""
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    model.load_state_dict(
        load_file(str(path / "model.safetensors"), device=str(device)), strict=True
    )
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return json.loads((path / "position.json").read_text())


def _metric_records(path: Path, up_to_step: int) -> list[str]:
    """metrics.jsonl lines of steps <= up_to_step; stops at a line cut short by a kill."""
    lines = []
    for ln in path.read_text().splitlines() if path.exists() else []:
        try:
            step = json.loads(ln)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            break
        if step <= up_to_step:
            lines.append(ln)
    return lines


def truncate_metrics(path: Path, up_to_step: int) -> None:
    """Cut metrics.jsonl back to the records of steps <= up_to_step (a resumed checkpoint's)."""
    lines = _metric_records(path, up_to_step)
    with atomic_path(path) as tmp:
        tmp.write_text("".join(f"{ln}\n" for ln in lines))
