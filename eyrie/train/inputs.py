"""What a training run reads, checked before its first step: the paths, the target against the
preflight report, and the shards.

Contract: every refusal comes before step 1, names the file and says what to do. A real run
refuses a rehearsal's shards; every shard is opened and checked against the run's expectations
on every rank, and each stored value is checked finite once per run (`VERIFIED_MARKER`). The shard
checks: docs/training.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eyrie.arch.target import fingerprint, read_config, tokenizer_hash
from eyrie.core.errors import EyrieError, ShardError
from eyrie.core.rehearsal import refuse_in_real_run
from eyrie.formats.hidden import ShardReader, read_meta, validate_shard
from eyrie.formats.report import shard_expectation
from eyrie.train.launch import Dist

VERIFIED_MARKER = "shards_verified.json"  # in the run folder: the value scan passed once


@dataclass
class TrainPaths:
    """The files a run reads and the folders it writes (`eyrie train`'s path arguments)."""

    target: Path  # the target model folder (resolved: its path goes into train.json)
    preflight: Path  # preflight.json
    vocab: Path  # vocab.safetensors (d2t, t2d)
    shards: list[Path]  # hidden-state HDF5 shards
    out_dir: Path  # draft/, metrics.jsonl, curves.png, tensorboard/, train.json; replaced whole
    state_dir: Path  # <run id>/step_<N>/ checkpoints, the run's metrics.jsonl and tensorboard/

    def __post_init__(self) -> None:
        self.target = Path(self.target).resolve()
        self.preflight, self.vocab = Path(self.preflight), Path(self.vocab)
        self.shards = [Path(s) for s in self.shards]
        self.out_dir, self.state_dir = Path(self.out_dir), Path(self.state_dir)

    def check_apart(self) -> None:
        """Refuse a state folder inside the output folder (which is replaced as a whole)."""
        if self.state_dir.resolve().is_relative_to(self.out_dir.resolve()):
            raise EyrieError(
                f"--state-dir {self.state_dir} is inside --out-dir {self.out_dir}; keep them apart "
                "(the output folder is replaced as a whole)"
            )


def check_target(p: TrainPaths) -> dict:
    """The preflight report's expectations, checked against the target folder."""
    expect = shard_expectation(p.preflight)
    for key, have in (
        ("fingerprint", fingerprint(read_config(p.target))),
        ("tokenizer_hash", tokenizer_hash(p.target)),
    ):
        want = expect["target_fingerprint" if key == "fingerprint" else key]
        if have != want:
            raise EyrieError(
                f"{p.preflight}: target.{key} is {want} but {p.target} has {have}; "
                "rerun eyrie preflight for this target"
            )
    return expect


def check_rehearsal(paths: list[Path], rehearsal: bool) -> None:
    """A real run refuses a rehearsal's shards (hidden states of random weights), naming the
    first; a rehearsal (`rehearsal`) trains on any."""
    if rehearsal:
        return
    found = [p for p in paths if _rehearsal_shard(p)]
    more = f" (and {len(found) - 1} more of the {len(paths)} shards)" if len(found) > 1 else ""
    first = f"{found[0]}{more}" if found else None
    refuse_in_real_run(
        first, "a hidden-state shard", "train on the shards", "hidden/", "training", ShardError
    )


def _rehearsal_shard(path: Path) -> bool:
    try:
        return read_meta(path).rehearsal
    except ShardError:
        return False  # unreadable: verify_shards reports it, with every other bad shard


def verify_shards(paths: list[Path], expect: dict, scan_values: bool, dist: Dist) -> None:
    """Refuse bad shards before any step, all of them in one line with the way to rebuild them.

    Every rank opens every shard (a truncated HDF5 file fails at open; attrs, the run's expected
    fields, shapes and offsets are checked). With `scan_values` every stored value is checked
    finite, the shards split over the ranks. Finite overwritten bytes cannot be told from data:
    the shard format has no checksums.
    """
    problems: list[tuple[int, str]] = []
    for i, path in enumerate(paths):
        try:
            ShardReader(path, expect=expect).close()
            if scan_values and i % dist.world == dist.rank:
                validate_shard(path, check_values=True)
        except ShardError as exc:
            problems.append((i, str(exc)))
    found = sorted({p for part in dist.gather(problems) for p in part})  # same error, every rank
    if found:
        bad = " ".join(str(paths[i]) for i in sorted({i for i, _ in found}))
        raise ShardError(
            "; ".join(msg for _, msg in found) + f" -- to rebuild: delete {bad} and "
            f"rerun snakemake (or: snakemake --force {bad})"
        )
