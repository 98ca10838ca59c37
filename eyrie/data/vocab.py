"""The draft vocabulary map: the target tokens the draft's lm_head predicts.

`eyrie vocab --target DIR --shards S [S ...] --out vocab.safetensors --settings JSON` counts the
assistant (loss-masked) tokens of the tokenized training shards and keeps the
`vocab.draft_vocab_size` most frequent target ids, stored as `d2t`/`t2d` with `vocab.json`
(coverage, counts, provenance) beside it. How ids are chosen: docs/data.md#the-vocabulary-map;
the file: docs/contracts.md#files (read back by `eyrie.formats.vocab`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file

from eyrie.config.stages import VocabSettings
from eyrie.core.errors import VocabError
from eyrie.core.io import atomic_path, provenance, write_json

log = logging.getLogger(__name__)


def _flat(table: pa.Table, column: str) -> tuple[np.ndarray, np.ndarray]:
    """Flattened values and per-row lengths of a list column."""
    arr = table.column(column).combine_chunks()  # a ListArray
    return (
        arr.flatten().to_numpy(zero_copy_only=False),
        arr.value_lengths().fill_null(0).to_numpy(zero_copy_only=False),
    )


def count_assistant_tokens(
    shards: list[str | Path], vocab_size: int
) -> tuple[np.ndarray, list[dict]]:
    """Frequency of every target id over loss-masked tokens of `shards`.

    Returns (counts int64 [vocab_size], per-shard stats). Refuses ids outside [0, vocab_size).
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    stats = []
    for path in shards:
        path = Path(path)
        table = _read_shard(path)
        ids, masked = _assistant_ids(path, table, vocab_size)
        counts += np.bincount(masked, minlength=vocab_size)
        stats.append(
            {
                "path": str(path),
                "records": table.num_rows,
                "tokens": int(ids.size),
                "assistant_tokens": int(masked.size),
            }
        )
        log.info("%s: %d records, %d assistant tokens", path, table.num_rows, masked.size)
    return counts, stats


def _read_shard(path: Path) -> pa.Table:
    if not path.is_file():
        raise VocabError(f"{path}: tokenized shard not found; run `eyrie tokenize` first")
    try:
        return pq.read_table(path, columns=["sample_id", "input_ids", "loss_mask"])
    except (pa.ArrowInvalid, KeyError, OSError) as exc:
        raise VocabError(
            f"{path}: not a tokenized shard ({' '.join(str(exc).split())}); re-run `eyrie tokenize`"
        ) from exc


def _assistant_ids(path: Path, table: pa.Table, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(every token id [T] int32, the loss-masked ones [M] int64), checked against the target."""
    ids, id_lens = _flat(table, "input_ids")  # ids: [T] int32
    mask, mask_lens = _flat(table, "loss_mask")  # mask: [T] uint8
    if not np.array_equal(id_lens, mask_lens):
        row = int(np.flatnonzero(id_lens != mask_lens)[0])
        raise VocabError(
            f"{path}: sample {table.column('sample_id')[row]}: input_ids has "
            f"{id_lens[row]} tokens but loss_mask {mask_lens[row]}; re-run `eyrie tokenize`"
        )
    masked = ids[mask.astype(bool)].astype(np.int64)
    if masked.size and (masked.min() < 0 or masked.max() >= vocab_size):
        bad = int(masked.max() if masked.max() >= vocab_size else masked.min())
        raise VocabError(
            f"{path}: token id {bad} is outside the target vocabulary (vocab_size "
            f"{vocab_size} in config.json); tokenize with this target's tokenizer"
        )
    return ids, masked


def select_draft_ids(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """Ascending target ids of the draft vocabulary (int64 [draft_vocab_size]).

    counts: int64 [target_vocab]. The most frequent ids, ties by lower id; when fewer than
    draft_vocab_size ids occurred, filled with the lowest ids not chosen yet.
    """
    vocab_size = counts.shape[0]
    if draft_vocab_size > vocab_size:
        raise VocabError(
            f"vocab.draft_vocab_size={draft_vocab_size} is larger than the target vocabulary "
            f"({vocab_size}); set vocab.draft_vocab_size <= {vocab_size}"
        )
    seen = np.flatnonzero(counts > 0)
    by_freq = seen[np.lexsort((seen, -counts[seen]))]  # primary key: -count, then id
    chosen = by_freq[:draft_vocab_size]
    if chosen.size < draft_vocab_size:
        unused = np.setdiff1d(np.arange(vocab_size), chosen, assume_unique=True)
        chosen = np.concatenate([chosen, unused[: draft_vocab_size - chosen.size]])
    return np.sort(chosen).astype(np.int64)


def vocab_mappings(draft_ids: np.ndarray, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [N], t2d bool [vocab_size]) for ascending `draft_ids` [N]: id = i + d2t[i]."""
    ids = torch.from_numpy(np.asarray(draft_ids, dtype=np.int64))
    d2t = ids - torch.arange(ids.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def build_vocab(
    target: str | Path, shards: list[str | Path], out: str | Path, settings: dict
) -> dict:
    """The whole stage: write `out` (d2t, t2d) and vocab.json beside it; return the stats."""
    from eyrie.arch.target import inspect_target

    size = VocabSettings.from_settings(settings).draft_vocab_size
    if not shards:
        raise VocabError("no tokenized shards given; pass --shards shard_000.parquet ...")
    vocab_size = inspect_target(target).vocab_size
    if size > vocab_size:
        raise VocabError(
            f"vocab.draft_vocab_size={size} is larger than the target vocabulary "
            f"({vocab_size} in {Path(target) / 'config.json'}); set it <= {vocab_size}"
        )
    counts, shard_stats = count_assistant_tokens(shards, vocab_size)
    if int(counts.sum()) == 0:
        raise VocabError(
            f"{shards[0]}: no loss-masked tokens in the given shards; check the tokenize report"
        )
    draft_ids = select_draft_ids(counts, size)
    d2t, t2d = vocab_mappings(draft_ids, vocab_size)
    stats = {
        **_coverage(counts, draft_ids),
        "shards": shard_stats,
        "provenance": provenance(settings),
    }
    out = Path(out)
    with atomic_path(out) as tmp:
        save_file({"d2t": d2t, "t2d": t2d}, str(tmp))
        back = load_file(str(tmp))  # validate before the rename
        assert torch.equal(back["d2t"], d2t) and torch.equal(back["t2d"], t2d)
    write_json(out.with_suffix(".json"), stats)
    log.info(
        "draft vocab %d of %d ids covers %.4f of %d assistant tokens (%d distinct) -> %s",
        size,
        vocab_size,
        stats["coverage"],
        stats["assistant_tokens"],
        stats["distinct_assistant_tokens"],
        out,
    )
    return stats


def _coverage(counts: np.ndarray, draft_ids: np.ndarray) -> dict:
    """How much of the assistant tokens (counts int64 [target_vocab]) `draft_ids` [N] cover."""
    total = int(counts.sum())
    distinct = int(np.count_nonzero(counts))
    in_vocab = counts[draft_ids]
    return {
        "draft_vocab_size": int(draft_ids.shape[0]),
        "target_vocab_size": int(counts.shape[0]),
        "assistant_tokens": total,
        "distinct_assistant_tokens": distinct,
        "coverage": float(in_vocab.sum() / total),
        "filled_unseen_ids": max(0, int(draft_ids.shape[0]) - distinct),
        "min_count_in_vocab": int(in_vocab.min()),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", required=True, help="Hugging Face model folder (config.json vocab_size)"
    )
    parser.add_argument(
        "--shards", required=True, nargs="+", help="tokenized training shards (.parquet)"
    )
    parser.add_argument(
        "--out", required=True, help="vocab.safetensors to write (vocab.json goes beside it)"
    )


def run(args: argparse.Namespace) -> int:
    build_vocab(args.target, args.shards, args.out, args.settings)
    return 0
