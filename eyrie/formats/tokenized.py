"""Tokenized shards: the parquet schemas `eyrie tokenize` writes, and their two readers.

`shard_NNN.parquet` rows are (sample_id, input_ids list<int32>, loss_mask list<uint8>);
`eval.parquet` adds prompt_ids. `read_tokenized` (extraction) and `read_prompts` (evaluation)
check what they read against the target's vocabulary and name the sample and the fix when it does
not fit. The columns: docs/contracts.md#files.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eyrie.core.errors import EvaluateError, ExtractError

log = logging.getLogger(__name__)


SHARD_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
    ]
)


EVAL_SCHEMA = SHARD_SCHEMA.append(pa.field("prompt_ids", pa.list_(pa.int32())))


# (sample_ids, input_ids int32 [T_i] per sample, loss_masks uint8 [T_i] per sample)
Tokenized = tuple[list[str], list[np.ndarray], list[np.ndarray]]


def _list_column(
    table, name: str, path: Path, sample_ids: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """A list<int> column as (flat values int64 [sum T_i], offsets int64 [S + 1])."""
    col = table.column(name).combine_chunks()
    if not (
        pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
    ) or not pa.types.is_integer(col.type.value_type):
        raise ExtractError(
            f"{path}: column {name!r} has type {col.type}, expected list<int>; "
            "rerun `eyrie tokenize`"
        )
    if col.null_count:
        bad = sample_ids[col.is_null().to_numpy(zero_copy_only=False).argmax()]
        raise ExtractError(f"{path}: sample {bad}: {name} is null; rerun `eyrie tokenize`")
    offsets = col.offsets.to_numpy().astype(np.int64)
    values = col.values.to_numpy().astype(np.int64)[offsets[0] : offsets[-1]]
    return values, offsets - offsets[0]


def read_tokenized(path: str | Path, vocab_size: int) -> Tokenized:
    """A tokenized shard as (sample_ids, input_ids int32 [T_i], loss_masks uint8 [T_i])."""
    path = Path(path)
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow raises ArrowInvalid (a ValueError) on bad files
        raise ExtractError(f"{path}: unreadable parquet ({exc}); rerun `eyrie tokenize`") from exc
    missing = [c for c in ("sample_id", "input_ids", "loss_mask") if c not in table.column_names]
    if missing:
        raise ExtractError(f"{path}: column {missing[0]!r} missing; rerun `eyrie tokenize`")
    sample_ids = [str(s) for s in table.column("sample_id").to_pylist()]
    ids, id_off = _list_column(table, "input_ids", path, sample_ids)
    mask, mask_off = _list_column(table, "loss_mask", path, sample_ids)
    lengths, mask_lengths = np.diff(id_off), np.diff(mask_off)
    for i in np.flatnonzero((lengths == 0) | (lengths != mask_lengths))[:1]:
        problem = (
            "no tokens"
            if lengths[i] == 0
            else f"{lengths[i]} input_ids but {mask_lengths[i]} loss_mask values"
        )
        raise ExtractError(f"{path}: sample {sample_ids[i]}: {problem}; rerun `eyrie tokenize`")
    outside = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if len(outside):
        i = int(np.searchsorted(id_off, outside[0], side="right")) - 1
        raise ExtractError(
            f"{path}: sample {sample_ids[i]}: token id {int(ids[outside[0]])} outside "
            f"the target's vocabulary 0..{vocab_size - 1}; tokenize with the "
            "target's tokenizer"
        )
    if np.any((mask != 0) & (mask != 1)):
        raise ExtractError(f"{path}: loss_mask holds values other than 0/1; rerun `eyrie tokenize`")
    ids32, mask8 = ids.astype(np.int32), mask.astype(np.uint8)
    input_ids = [ids32[a:b] for a, b in zip(id_off[:-1], id_off[1:])]
    loss_masks = [mask8[a:b] for a, b in zip(mask_off[:-1], mask_off[1:])]
    return sample_ids, input_ids, loss_masks


def read_prompts(
    path: str | Path, num_prompts: int, vocab_size: int
) -> list[tuple[str, list[int]]]:
    """(sample_id, prompt_ids) of the first `num_prompts` rows of eval.parquet."""
    path = Path(path)
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:
        raise EvaluateError(f"{path}: unreadable parquet ({exc}); rerun `eyrie tokenize`") from exc
    for col in ("sample_id", "prompt_ids"):
        if col not in table.column_names:
            raise EvaluateError(f"{path}: column {col!r} missing; rerun `eyrie tokenize`")
    if table.num_rows < num_prompts:
        log.warning(
            "%s has %d prompts, fewer than eval.num_prompts=%d; using all of them",
            path,
            table.num_rows,
            num_prompts,
        )
    rows = table.slice(0, num_prompts)
    prompts = []
    for sid, ids in zip(
        rows.column("sample_id").to_pylist(), rows.column("prompt_ids").to_pylist()
    ):
        ids = [int(i) for i in ids or []]
        if not ids:
            raise EvaluateError(f"{path}: sample {sid}: empty prompt_ids; rerun `eyrie tokenize`")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise EvaluateError(
                f"{path}: sample {sid}: token id outside the target's vocabulary "
                f"0..{vocab_size - 1}; tokenize with the target's tokenizer"
            )
        prompts.append((str(sid), ids))
    if not prompts:
        raise EvaluateError(
            f"{path}: no prompts; set data.num_eval >= 1 and rerun `eyrie tokenize`"
        )
    return prompts
