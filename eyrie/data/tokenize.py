"""Conversations -> tokenized shards with assistant-only loss masks, and a held-out eval split.

`eyrie tokenize --target DIR --inputs F [F ...] --out-dir DIR --settings JSON` writes
`shard_NNN.parquet`, `eval.parquet` and `report.json` into DIR, all at once. Every unusable record
is counted by reason and listed in report.json, or with `data.strict: true` stops the stage.
How records are read, masked and split: docs/data.md; the files: docs/contracts.md#files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
from dataclasses import dataclass, field, fields
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eyrie.data.chat import load_chat_tokenizer, prompt_ids, render_with_mask
from eyrie.data.records import (
    REASONS,
    RawRecord,
    RecordError,
    read_records,
    to_messages,
)
from eyrie.errors import DataError, TargetError
from eyrie.formats.tokenized import EVAL_SCHEMA, SHARD_SCHEMA
from eyrie.io import atomic_path, provenance
from eyrie.settings import load_settings

log = logging.getLogger(__name__)


LOG_EVERY = 5000


# listed in dropped_by_reason only when they occur, so that reports of clean inputs keep their keys
LISTED_WHEN_SEEN = ("bad_encoding",)


TOP_REASONS = 3  # reasons named in the "too few usable records" error


@dataclass(frozen=True)
class DataSettings:
    max_seq_len: int
    num_shards: int
    num_eval: int
    seed: int
    strict: bool

    @classmethod
    def from_settings(cls, settings: dict) -> "DataSettings":
        """The `data` section, checked and defaulted by the schema (every problem at once)."""
        data = load_settings(settings, ["data"], DataError)["data"]
        return cls(**{f.name: data[f.name] for f in fields(cls)})


@dataclass
class Example:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    messages: list[dict] = field(repr=False)


@dataclass
class Tally:
    records_read: int = 0
    truncated: int = 0
    dropped: list[dict] = field(default_factory=list)
    per_file: dict = field(default_factory=dict)

    def by_reason(self) -> dict[str, int]:
        counts = {r: 0 for r in REASONS if r not in LISTED_WHEN_SEEN}
        for d in self.dropped:
            counts[d["reason"]] = counts.get(d["reason"], 0) + 1
        return counts

    def top_reasons(self, limit: int) -> str:
        """The most frequent reasons as "reason N (e.g. file:line)", most frequent first."""
        counts = {r: n for r, n in self.by_reason().items() if n}
        if not counts:
            return "none"
        ranked = sorted(counts, key=lambda r: (-counts[r], list(REASONS).index(r)))
        first = {}
        for d in self.dropped:
            first.setdefault(d["reason"], f"{d['file']}:{d['line']}")
        named = [f"{r} {counts[r]} (e.g. {first[r]})" for r in ranked[:limit]]
        more = len(ranked) - limit
        return ", ".join(named) + (f", and {more} more reason(s)" if more > 0 else "")

    def drop(self, raw: RawRecord, err: RecordError) -> None:
        self.dropped.append(
            {"file": raw.file, "line": raw.line, "reason": err.reason, "detail": err.detail}
        )


def tokenize_record(tokenizer, raw: RawRecord, max_seq_len: int) -> tuple[Example, bool]:
    """One record -> (example cut to max_seq_len, whether it was cut); RecordError if unusable."""
    if raw.error is not None:
        raise raw.error
    messages = to_messages(raw.obj)
    ids, mask = render_with_mask(tokenizer, messages)
    truncated = len(ids) > max_seq_len
    ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    if not any(mask):
        raise RecordError(
            "no_assistant_tokens_after_truncation",
            f"the first assistant token is beyond max_seq_len={max_seq_len}",
        )
    return Example(raw.sample_id, ids, mask, messages), truncated


def collect_examples(
    tokenizer, inputs: list[str | Path], max_seq_len: int, strict: bool
) -> tuple[list[Example], Tally]:
    """Every record of `inputs` in order, tokenized; unusable ones counted (strict: raised)."""
    _require_files(inputs)
    examples, tally = [], Tally()
    for path in inputs:
        read_before, used_before = tally.records_read, len(examples)
        for raw in read_records(path):
            tally.records_read += 1
            try:
                example, truncated = tokenize_record(tokenizer, raw, max_seq_len)
            except RecordError as err:
                if strict:
                    raise _strict_error(raw, err) from err
                tally.drop(raw, err)
                continue
            examples.append(example)
            tally.truncated += truncated
            if tally.records_read % LOG_EVERY == 0:
                log.info("%d records read, %d usable", tally.records_read, len(examples))
        read, used = tally.records_read - read_before, len(examples) - used_before
        tally.per_file[str(path)] = {
            "records_read": read,
            "records_used": used,
            "sha256": _sha256(path),
        }
        log.info("%s: %d records, %d usable", path, read, used)
    return examples, tally


def _require_files(inputs: list[str | Path]) -> None:
    """Every input file exists, checked before any is read: one error for all that are missing."""
    missing = [str(p) for p in inputs if not Path(p).is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DataError(f"{missing[0]}: input file not found{more}; fix data.conversations")


def _strict_error(raw: RawRecord, err: RecordError) -> DataError:
    return DataError(
        f"{raw.sample_id}: {err.reason}: {err.detail}; {REASONS[err.reason]} "
        "(or set data.strict: false to count and skip such records)"
    )


def split_examples(
    examples: list[Example], num_eval: int, num_shards: int, seed: int
) -> tuple[list[Example], list[list[Example]]]:
    """Shuffle with `seed`: the first num_eval are eval, the rest cut into contiguous shards."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    shuffled = [examples[i] for i in order]
    held_out, rest = shuffled[:num_eval], shuffled[num_eval:]
    base, extra = divmod(len(rest), num_shards)
    shards, pos = [], 0
    for s in range(num_shards):
        size = base + (s < extra)
        shards.append(rest[pos : pos + size])
        pos += size
    return held_out, shards


def _table(examples: list[Example], with_prompt: list[list[int]] | None = None) -> pa.Table:
    columns = {
        "sample_id": [e.sample_id for e in examples],
        "input_ids": [e.input_ids for e in examples],
        "loss_mask": [e.loss_mask for e in examples],
    }
    if with_prompt is None:
        return pa.table(columns, schema=SHARD_SCHEMA)
    return pa.table({**columns, "prompt_ids": with_prompt}, schema=EVAL_SCHEMA)


def _stats(examples: list[Example]) -> dict:
    return {
        "records": len(examples),
        "tokens": sum(len(e.input_ids) for e in examples),
        "assistant_tokens": sum(sum(e.loss_mask) for e in examples),
    }


def _sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def tokenize(
    target: str | Path, inputs: list[str | Path], out_dir: str | Path, settings: dict
) -> dict:
    """The whole stage: shards, eval.parquet and report.json into `out_dir`; returns the report."""
    cfg = DataSettings.from_settings(settings)
    trust = settings.get("trust_remote_code", False)
    if not isinstance(trust, bool):
        raise DataError(f"trust_remote_code={trust!r}: must be true or false")
    if not inputs:
        raise DataError("no input files; set data.conversations")
    tokenizer = load_chat_tokenizer(target, trust)
    log.info(
        "tokenizing %d file(s) with the chat template of %s (max_seq_len=%d)",
        len(inputs),
        target,
        cfg.max_seq_len,
    )
    examples, tally = collect_examples(tokenizer, inputs, cfg.max_seq_len, cfg.strict)
    _require_enough(examples, tally, cfg)
    held_out, shards = split_examples(examples, cfg.num_eval, cfg.num_shards, cfg.seed)
    prompts = [prompt_ids(tokenizer, e.messages) for e in held_out]
    report = {
        "target": str(target),
        "tokenizer_hash": _tokenizer_hash(target),
        "inputs": tally.per_file,
        "records_read": tally.records_read,
        "records_used": len(examples),
        "records_dropped": len(tally.dropped),
        "dropped_by_reason": tally.by_reason(),
        "dropped": tally.dropped,
        "truncated": tally.truncated,
        "max_seq_len": cfg.max_seq_len,
        "eval": {"file": "eval.parquet", **_stats(held_out)},
        "shards": [
            {"file": f"shard_{s:03d}.parquet", **_stats(shard)} for s, shard in enumerate(shards)
        ],
        "provenance": provenance(settings),
    }
    _write_outputs(out_dir, shards, held_out, prompts, report)
    _log_summary(report, out_dir)
    return report


def _require_enough(examples: list[Example], tally: Tally, cfg: DataSettings) -> None:
    need = cfg.num_eval + cfg.num_shards
    if len(examples) < need:
        fix = ", or fix the dropped records (data.strict: true names the first)"
        fix = fix if tally.dropped else ""
        raise DataError(
            f"only {len(examples)} usable records of {tally.records_read} read (dropped: "
            f"{tally.top_reasons(TOP_REASONS)}); need at least data.num_eval + data.num_shards = "
            f"{cfg.num_eval} + {cfg.num_shards} = {need}: lower data.num_eval/data.num_shards "
            f"or add conversations{fix}"
        )


def _tokenizer_hash(target: str | Path) -> str | None:
    from eyrie.arch.target import tokenizer_hash

    try:
        return tokenizer_hash(target)
    except TargetError:
        return None


def _write_outputs(
    out_dir: str | Path,
    shards: list[list[Example]],
    held_out: list[Example],
    prompts: list[list[int]],
    report: dict,
) -> None:
    """The shards, eval.parquet and report.json, into `out_dir` at once (row counts checked)."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        for s, shard in enumerate(shards):
            pq.write_table(_table(shard), tmp / f"shard_{s:03d}.parquet")
        pq.write_table(_table(held_out, prompts), tmp / "eval.parquet")
        for entry in [*report["shards"], report["eval"]]:  # validate before the rename
            rows = pq.read_metadata(tmp / entry["file"]).num_rows
            assert rows == entry["records"], (entry["file"], rows, entry["records"])
        (tmp / "report.json").write_text(
            json.dumps(report, indent=2, sort_keys=True, default=str) + "\n"
        )


def _log_summary(report: dict, out_dir: str | Path) -> None:
    held_out = report["eval"]["records"]
    log.info(
        "%d records read, %d used (%d eval, %d in %d shards), %d dropped %s, %d truncated -> %s",
        report["records_read"],
        report["records_used"],
        held_out,
        report["records_used"] - held_out,
        len(report["shards"]),
        report["records_dropped"],
        {k: v for k, v in report["dropped_by_reason"].items() if v},
        report["truncated"],
        out_dir,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eyrie.runtime import settings_arg

    parser.add_argument(
        "--target", required=True, help="Hugging Face model folder with the tokenizer"
    )
    parser.add_argument(
        "--inputs", required=True, nargs="+", help="conversation files (.jsonl/.json/.parquet)"
    )
    parser.add_argument(
        "--out-dir", required=True, help="folder for shard_NNN.parquet, eval.parquet, report.json"
    )
    parser.add_argument(
        "--settings",
        required=True,
        type=settings_arg,
        help='JSON: {"data": {max_seq_len, num_shards, num_eval, seed, strict}, '
        '"trust_remote_code": bool}',
    )


def run(args: argparse.Namespace) -> int:
    tokenize(args.target, args.inputs, args.out_dir, args.settings)
    return 0
