"""A training run's resumable state: its run id, its step checkpoints and its metrics file.

Contract: `--state-dir/<run id>/step_<N>/` holds model.safetensors (all but the frozen tensors),
state.pt (optimizer, scheduler and RNG states; not at the plan's last step) and position.json; a
folder appears only complete (fsynced, renamed into place), and loading one restores every RNG to
where the saving run was. A resume reads the newest folder that verifies (a cut or garbled one is
skipped with a line saying why), and pruning never leaves the run without a good one. The run id
hashes the settings that change the weights and the identity of every input file. Layout and
semantics: docs/training.md ("Resume").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eyrie.arch.target import fingerprint, read_config
from eyrie.config.sections import NOT_IN_RUN_ID, TrainSettings, implied_before
from eyrie.core.errors import os_error_of
from eyrie.core.io import atomic_path
from eyrie.formats.report import identity, read_report
from eyrie.store.fingerprint import file_digest

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
    implied = implied_before()
    ident = {
        "settings": {
            k: v
            for k, v in dataclasses.asdict(cfg).items()
            if k not in NOT_IN_RUN_ID and implied.get(k, ...) != v
        },
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


class CheckpointProblem(Exception):
    """Why a step folder cannot be resumed from: one clause naming the file (the skip line's)."""


@dataclass
class Checkpoint:
    """A step folder read back and verified: all that `restore` applies."""

    path: Path
    position: dict  # POSITION_KEYS and more (packs_per_step, world_size)
    weights: dict[str, torch.Tensor]  # on the CPU; the draft's keys and shapes
    state: dict | None  # optimizer, scheduler, rng; None at the plan's last step (final)


POSITION_KEYS = ("step", "epoch", "step_in_epoch", "tokens", "wall_s", "run_id")


def is_last(step: int, steps_per_epoch: list[int]) -> bool:
    """Whether `step` is the plan's last: its checkpoint has no state.pt (nothing is left to
    train)."""
    return step == sum(steps_per_epoch)


def step_of(path: Path) -> int | None:
    """N of a step_<N> folder name; None for any other name."""
    digits = path.name.removeprefix("step_")
    return int(digits) if path.name.startswith("step_") and digits.isdigit() else None


def read_checkpoint(
    path: Path, model, optimizer, run_id: str, steps_per_epoch: list[int]
) -> Checkpoint:
    """`path` read and verified, cheapest check first; CheckpointProblem saying what is wrong.

    position.json parses, belongs to this run and names a step of its plan; model.safetensors is
    as long as its header says and holds the draft's keys and shapes; state.pt loads
    (weights_only) and fits the optimizer, but at the plan's last step, where nothing is left to
    train and the folder has no state.pt (final). What it cannot see: overwritten bytes of the
    right length (the files carry no checksums).
    """
    position = _read_position(path, run_id, steps_per_epoch)
    weights = _read_weights(path / "model.safetensors", model)
    last = is_last(position["step"], steps_per_epoch)
    state = None if last else _read_state(path / "state.pt", optimizer)
    return Checkpoint(path, position, weights, state)


def _read_position(path: Path, run_id: str, steps_per_epoch: list[int]) -> dict:
    try:
        position = json.loads((path / "position.json").read_text())
    except FileNotFoundError:
        raise CheckpointProblem("position.json missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointProblem(f"position.json does not parse: {exc}") from None
    if not isinstance(position, dict):
        raise CheckpointProblem("position.json is not a JSON object")
    missing = [k for k in POSITION_KEYS if k not in position]
    if missing:
        raise CheckpointProblem(f"position.json lacks {', '.join(missing)}")
    for key in POSITION_KEYS[:4]:
        if type(position[key]) is not int or position[key] < 0:
            raise CheckpointProblem(f"position.json {key} is {position[key]!r}, not a count")
    if type(position["wall_s"]) not in (int, float):
        raise CheckpointProblem(f"position.json wall_s is {position['wall_s']!r}, not seconds")
    if position["run_id"] != run_id:
        raise CheckpointProblem(f"position.json run_id is {position['run_id']!r}, not {run_id}")
    step, epoch, s = position["step"], position["epoch"], position["step_in_epoch"]
    if step != step_of(path):
        raise CheckpointProblem(f"position.json step is {step} but the folder is {path.name}")
    if (
        epoch >= len(steps_per_epoch)
        or s > steps_per_epoch[epoch]
        or (step != sum(steps_per_epoch[:epoch]) + s)
    ):
        raise CheckpointProblem(
            f"position.json epoch {epoch} step {s} of the epoch is not step {step} of the plan"
        )
    return position


def frozen_keys(model) -> set[str]:
    """The draft's parameters that training never changes: the target's embedding and, where
    the draft keeps them, its lm_head rows and final norm (loaded from the target at every
    build; the run id holds the target's content)."""
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def stored_state(model) -> dict[str, torch.Tensor]:
    """What a checkpoint holds: the state_dict without the frozen parameters (Kimi-K2.5's
    embedding alone is 4.7 GB in float32)."""
    frozen = frozen_keys(model)
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def _read_weights(path: Path, model) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: the draft's stored_state (or, written by an older eyrie, its
    whole state_dict), by name and shape."""
    from safetensors.torch import load_file

    _check_safetensors_length(path)
    try:
        weights = load_file(str(path), device="cpu")
    except Exception as exc:  # noqa: BLE001 - the loader's many errors are one problem here
        raise CheckpointProblem(f"{path.name} does not load: {exc}") from None
    full = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in weights.items()}
    want = full if have.keys() == full.keys() else {k: full[k] for k in stored_state(model)}
    if have != want:
        diff = sorted(set(have) ^ set(want)) or [k for k in want if have[k] != want[k]]
        raise CheckpointProblem(
            f"{path.name} does not fit the draft: {len(diff)} tensor(s) differ in name or shape, "
            f"first {diff[0]} with shape {have.get(diff[0])} here, {want.get(diff[0])} in the draft"
        )
    return weights


def _check_safetensors_length(path: Path) -> None:
    """The file is 8 + header + the end of its last tensor bytes long: a cut file is shorter."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 8 <= size and 8 + n <= size else None
    except FileNotFoundError:
        raise CheckpointProblem(f"{path.name} missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointProblem(f"{path.name} header does not parse: {exc}") from None
    if header is None:
        raise CheckpointProblem(
            f"{path.name} is {size:,} bytes, shorter than its header: truncated"
        )
    try:
        end = max(
            (t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0
        )
    except (AttributeError, KeyError, TypeError, IndexError):
        raise CheckpointProblem(f"{path.name} header has no tensor offsets") from None
    if size != 8 + n + end:
        cut = "truncated" if size < 8 + n + end else "bytes after the last tensor"
        raise CheckpointProblem(
            f"{path.name} is {size:,} bytes, its header says {8 + n + end:,}: {cut}"
        )


def _read_state(path: Path, optimizer) -> dict:
    """state.pt by torch.load(weights_only=True); a torch.save archive is a zip file, whose
    directory at the end is missing from a cut or overwritten one (read first: cheap)."""
    try:
        size = path.stat().st_size
        archive = zipfile.is_zipfile(path)
    except FileNotFoundError:
        raise CheckpointProblem(f"{path.name} missing") from None
    if not archive:
        raise CheckpointProblem(
            f"{path.name} is {size:,} bytes without the zip directory a torch.save archive ends "
            "with: cut short or overwritten"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load's many errors are one problem here
        first = str(exc).split(". ")[0].strip()[:160]
        raise CheckpointProblem(
            f"{path.name} does not load ({type(exc).__name__}: {first})"
        ) from None
    if not isinstance(state, dict) or not {"optimizer", "scheduler", "rng"} <= state.keys():
        raise CheckpointProblem(f"{path.name} lacks the optimizer, scheduler or RNG states")
    try:
        saved = [len(g["params"]) for g in state["optimizer"]["param_groups"]]
    except (KeyError, TypeError):
        raise CheckpointProblem(f"{path.name} has no optimizer parameter groups") from None
    if saved != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointProblem(
            f"{path.name} optimizer groups hold {saved} parameters, the draft's "
            f"{[len(g['params']) for g in optimizer.param_groups]}"
        )
    return state


def restore(ckpt: Checkpoint, model, optimizer, scheduler) -> dict:
    """Apply a verified checkpoint: weights (the frozen ones stay the build's), optimizer,
    scheduler and RNG states (a final one: the weights alone); its position."""
    from eyrie.train.sharding import is_sharded, load_full

    # the frozen parameters are the target's own, loaded at the build (_read_weights checked
    # that the checkpoint holds every other tensor)
    moments = None if ckpt.state is None else ckpt.state["optimizer"]
    if is_sharded(model):  # whole tensors to each rank's shards (train.fsdp)
        load_full(model, optimizer, ckpt.weights, moments)
    else:
        model.load_state_dict(ckpt.weights, strict=False)
        if moments is not None:
            optimizer.load_state_dict(moments)
    if ckpt.state is None:
        return ckpt.position
    scheduler.load_state_dict(ckpt.state["scheduler"])
    _set_rng_state(ckpt.state["rng"])
    return ckpt.position


class Checkpoints:
    """The step_<N>/ folders of one run: the newest that verifies, saving, and pruning that
    never leaves the run without a good checkpoint.

    A folder that failed verification stays until a new checkpoint is saved (it may be all that
    is left of the run); then it goes, with a line. A folder this process wrote (fsynced,
    renamed into place) counts as good; pruning keeps the newest KEEP_CHECKPOINTS good ones.
    """

    def __init__(self, run_dir: Path, run_id: str, steps_per_epoch: list[int]):
        self.run_dir, self.run_id, self.steps_per_epoch = run_dir, run_id, steps_per_epoch
        self.failed: dict[Path, str] = {}  # folders that failed verification: why

    def folders(self) -> list[Path]:
        """Every step_<N> folder, oldest first."""
        found = [p for p in self.run_dir.glob("step_*") if step_of(p) is not None and p.is_dir()]
        return sorted(found, key=step_of)

    def read(self, path: Path, model, optimizer) -> Checkpoint:
        """`path` read and verified against this run (`read_checkpoint`)."""
        return read_checkpoint(path, model, optimizer, self.run_id, self.steps_per_epoch)

    def newest_good(self, model, optimizer) -> Checkpoint | None:
        """The newest folder that verifies, read; a line for each newer one skipped and why."""
        found = None
        for path in reversed(self.folders()):
            try:
                found = self.read(path, model, optimizer)
                break
            except CheckpointProblem as exc:
                self.failed[path] = str(exc)
        after = f"; resuming from {found.path}" if found else ""
        for path, why in self.failed.items():
            log.warning("skipped checkpoint %s (%s)%s", path, why, after)
        if found is None and self.failed:
            log.warning(
                "no checkpoint in %s verifies: training from step 0 (the %d skipped stay until "
                "its first checkpoint is saved)",
                self.run_dir,
                len(self.failed),
            )
        return found

    def save(self, model, optimizer, scheduler, position: dict, whole=None) -> Path:
        """Write step_<N>/ atomically (fsynced), then prune (`_prune`). At the plan's last step
        the optimizer, scheduler and RNG states are not written: no step is left to use them
        (AdamW's two moments are twice the trainable weights: ~9 GB for a Kimi-width draft).
        `whole`: a sharded draft's (weights, optimizer state) gathered whole
        (eyrie.train.sharding.full_states), written as one process's are."""
        final = self.run_dir / f"step_{position['step']:08d}"
        weights, moments = whole or (stored_state(model), None)
        try:
            self._write(final, weights, moments or optimizer.state_dict, scheduler, position)
        except Exception as exc:  # a full disk names the checkpoint, not the stage's --out-dir
            number, filename, _ = os_error_of(exc)
            if number is None or filename is not None:
                raise
            raise OSError(number, os.strerror(number), str(final)) from exc
        self._prune(final)
        return final

    def _write(self, final: Path, weights: dict, moments, scheduler, position: dict) -> None:
        """`moments`: the optimizer's state_dict, or the call that makes it (read only where
        it is written)."""
        from safetensors.torch import save_file

        with atomic_path(final) as tmp:
            tmp.mkdir()
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in weights.items()},
                str(tmp / "model.safetensors"),
            )
            if not is_last(position["step"], self.steps_per_epoch):
                torch.save(
                    {
                        "optimizer": moments() if callable(moments) else moments,
                        "scheduler": scheduler.state_dict(),
                        "rng": _rng_state(),
                    },
                    tmp / "state.pt",
                )
            (tmp / "position.json").write_text(json.dumps(position, indent=2, sort_keys=True))

    def _prune(self, newest: Path) -> None:
        """With `newest` just written: the folders that failed verification go (a line each),
        then the good ones beyond the newest KEEP_CHECKPOINTS; `newest` always stays."""
        self.failed.pop(newest, None)  # replaced by the one just written
        for path, why in self.failed.items():
            if path.exists():
                log.info("removed checkpoint %s (%s): %s is saved", path, why, newest)
                shutil.rmtree(path, ignore_errors=True)
        self.failed.clear()
        for old in self.folders()[:-KEEP_CHECKPOINTS]:
            if old != newest:
                shutil.rmtree(old)


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
