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

from eyrie.config.schema import load_settings
from eyrie.core.errors import DataError, TargetError
from eyrie.core.io import atomic_path, keep_last_good, provenance
from eyrie.data.chat import ChatTemplate
from eyrie.data.inputs import read_records
from eyrie.data.records import (
    REASONS,
    Conversation,
    RawRecord,
    RecordError,
    to_conversation,
)
from eyrie.data.turns import (
    TURN_COUNTS,
    MaskSettings,
    check_mode,
    masked_samples,
    prompt_ids,
    template_traits,
)
from eyrie.formats.tokenized import EVAL_SCHEMA, SHARD_SCHEMA

log = logging.getLogger(__name__)


LOG_EVERY = 5000


# listed in dropped_by_reason only when they occur, so that reports of clean inputs keep their keys
LISTED_WHEN_SEEN = (
    "bad_encoding",
    "record_too_large",
    "bad_tool_calls",
    "duplicate",
    "shares_eval_prompt",
    "regenerate_cut",
    "regenerate_failed",
    "template_rule",
)


TOP_REASONS = 3  # reasons named in the "too few usable records" error


@dataclass(frozen=True)
class DataSettings:
    max_seq_len: int
    num_shards: int
    num_eval: int
    seed: int
    strict: bool
    mask_mode: str
    train_reasoning: bool
    non_text: str
    regenerate: bool
    chat_template_kwargs: dict

    @classmethod
    def from_settings(cls, settings: dict) -> "DataSettings":
        """The `data` section, checked and defaulted by the schema (every problem at once)."""
        data = load_settings(settings, ["data"], DataError)["data"]
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    @property
    def mask(self) -> MaskSettings:
        return MaskSettings(self.mask_mode, self.train_reasoning)


@dataclass
class Example:
    """One training sample (a record expanded per turn gives several, ids `<record>#<turn>`)."""

    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class Record:
    """One usable conversation and its samples."""

    raw: RawRecord
    conv: Conversation
    examples: list[Example]
    mode: str  # the mask mode that made the samples: prefix | per_turn | generation
    truncated: int = 0  # samples cut to max_seq_len
    dropped_samples: int = 0  # samples with no assistant token left after the cut
    turns: dict = field(default_factory=dict)  # eyrie.data.turns.TURN_COUNTS

    @property
    def sample_id(self) -> str:
        return self.raw.sample_id


@dataclass
class Tally:
    records_read: int = 0
    dropped: list[dict] = field(default_factory=list)
    per_file: dict = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)  # the usable ones, in input order

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
        top = next(d for d in self.dropped if d["reason"] == ranked[0])
        first[ranked[0]] += f": {top['detail']}"  # the template's own message, say
        named = [f"{r} {counts[r]} (e.g. {first[r]})" for r in ranked[:limit]]
        more = len(ranked) - limit
        return ", ".join(named) + (f", and {more} more reason(s)" if more > 0 else "")

    def by_rule(self) -> dict[str, int]:
        """Records dropped by template rule (template_rule's detail starts with the rule)."""
        counts: dict[str, int] = {}
        for d in self.dropped:
            if d["reason"] == "template_rule":
                rule = d["detail"].split(":", 1)[0]
                counts[rule] = counts.get(rule, 0) + 1
        return counts

    def drop(self, raw: RawRecord, err: RecordError) -> None:
        self.dropped.append(
            {"file": raw.file, "line": raw.line, "reason": err.reason, "detail": err.detail}
        )


def tokenize_conversation(
    tpl: ChatTemplate, raw: RawRecord, conv: Conversation, cfg: DataSettings
) -> Record:
    """One conversation -> its samples cut to max_seq_len; RecordError if none is usable."""
    masked = masked_samples(tpl, conv, cfg.mask, max_tokens=cfg.max_seq_len)
    many = len(masked.samples) > 1
    record = Record(raw, conv, [], masked.mode, turns=masked.counts)
    for k, (ids, mask) in enumerate(masked.samples):
        record.truncated += len(ids) > cfg.max_seq_len
        ids, mask = ids[: cfg.max_seq_len], mask[: cfg.max_seq_len]
        if not any(mask):
            record.dropped_samples += 1
            continue
        sample_id = f"{raw.sample_id}#{k}" if many else raw.sample_id
        record.examples.append(Example(sample_id, ids, mask))
    if not record.examples:
        raise RecordError(
            "no_assistant_tokens_after_truncation",
            f"the first assistant token is beyond max_seq_len={cfg.max_seq_len}",
        )
    return record


def conversation_of(raw: RawRecord, cfg: DataSettings) -> Conversation:
    """The record's conversation; RecordError (its reading error, or why it is unusable)."""
    if raw.error is not None:
        raise raw.error
    return to_conversation(raw.obj, cfg.non_text)


def tokenize_record(tpl: ChatTemplate, raw: RawRecord, cfg: DataSettings) -> Record:
    """One raw record -> its Record; RecordError if unusable."""
    return tokenize_conversation(tpl, raw, conversation_of(raw, cfg), cfg)


def collect_records(tpl: ChatTemplate, inputs: list[str | Path], cfg: DataSettings) -> Tally:
    """Every record of `inputs` in order, tokenized; unusable ones and later copies of a
    conversation counted (strict: the first unusable one raised)."""
    _require_files(inputs)
    tally, seen = Tally(), {}
    for path in inputs:
        read_before, used_before = tally.records_read, len(tally.records)
        for raw in read_records(path):
            tally.records_read += 1
            try:
                record = _usable(tpl, raw, cfg, seen)
            except RecordError as err:
                if cfg.strict and err.reason != "duplicate":
                    raise _strict_error(raw, err) from err
                tally.drop(raw, err)
                continue
            tally.records.append(record)
            if tally.records_read % LOG_EVERY == 0:
                log.info("%d records read, %d usable", tally.records_read, len(tally.records))
        read, used = tally.records_read - read_before, len(tally.records) - used_before
        tally.per_file[str(path)] = {
            "records_read": read,
            "records_used": used,
            "sha256": _sha256(path),
        }
        log.info("%s: %d records, %d usable", path, read, used)
        _require_some(path, read, used, tally)
    return tally


def _require_some(path, read: int, used: int, tally: Tally) -> None:
    """A file none of whose records is usable (an unknown schema, say) stops the stage: its
    counts in report.json alone would train silently without it. Copies of conversations
    already read (a file listed twice) are not a mistake."""
    if not read or used:
        return
    own = Tally(dropped=[d for d in tally.dropped if d["file"] == str(path)])
    if all(d["reason"] == "duplicate" for d in own.dropped):
        return
    raise DataError(
        f"{path}: none of its {read} records is usable ({own.top_reasons(TOP_REASONS)}); fix "
        "the file (docs/data.md#input-files gives the formats read) or remove it from "
        "data.conversations"
    )


def _usable(tpl: ChatTemplate, raw: RawRecord, cfg: DataSettings, seen: dict[str, str]) -> Record:
    """The record tokenized, unless it repeats a conversation already kept (`seen`: key -> id)."""
    conv = conversation_of(raw, cfg)
    key = conv.key()
    if key in seen:
        raise RecordError("duplicate", f"the same conversation as {seen[key]}")
    record = tokenize_conversation(tpl, raw, conv, cfg)
    seen[key] = raw.sample_id
    return record


def _require_files(inputs: list[str | Path]) -> None:
    """Every input exists, checked before any is read: one error for all that are missing."""
    missing = [str(p) for p in inputs if not Path(p).exists()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DataError(f"{missing[0]}: input file not found{more}; fix data.conversations")


def _strict_error(raw: RawRecord, err: RecordError) -> DataError:
    return DataError(
        f"{raw.sample_id}: {err.reason}: {err.detail}; {REASONS[err.reason]} "
        "(or set data.strict: false to count and skip such records)"
    )


def split_records(
    records: list[Record], cfg: DataSettings, tally: Tally
) -> tuple[list[Record], list[list[Record]]]:
    """Shuffle with data.seed: the first num_eval are eval; the rest, less the records whose
    prompt is a held-out prompt (counted), cut into num_shards contiguous shards."""
    order = list(range(len(records)))
    random.Random(cfg.seed).shuffle(order)
    shuffled = [records[i] for i in order]
    held_out, rest = shuffled[: cfg.num_eval], shuffled[cfg.num_eval :]
    eval_prompts = {r.conv.prompt_key(): r.sample_id for r in held_out}
    kept = []
    for record in rest:
        other = eval_prompts.get(record.conv.prompt_key())
        if other is None:
            kept.append(record)
        else:
            tally.drop(record.raw, RecordError("shares_eval_prompt", f"eval record {other}"))
    base, extra = divmod(len(kept), cfg.num_shards)
    shards, pos = [], 0
    for s in range(cfg.num_shards):
        size = base + (s < extra)
        shards.append(kept[pos : pos + size])
        pos += size
    return held_out, shards


def read_regenerated(files: list[str | Path]) -> dict[str, dict]:
    """sample_id -> the regenerate stage's line for it, from all its shard files."""
    out = {}
    for path in files:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                try:
                    entry = json.loads(line)
                    out[entry["sample_id"]] = entry
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise DataError(
                        f"{path}:{lineno}: not a regenerated record ({type(exc).__name__}); "
                        "delete the file to regenerate it"
                    ) from exc
    return out


def regenerated_shards(
    tpl: ChatTemplate,
    shards: list[list[Record]],
    regenerated: dict[str, dict],
    cfg: DataSettings,
    tally,
) -> list[list[Record]]:
    """Each training record replaced by its regenerated version; cut, failed or unusable ones
    dropped and counted. A record the regenerated files do not hold stops the stage."""
    out = []
    for shard in shards:
        out.append([])
        for record in shard:
            entry = regenerated.get(record.sample_id)
            if entry is None:
                raise DataError(
                    f"{record.sample_id}: not in the regenerated files; they are stale: "
                    "delete results/<name>/regenerated to regenerate"
                )
            try:
                out[-1].append(_regenerated_record(tpl, record.raw, entry, cfg))
            except RecordError as err:
                tally.drop(record.raw, err)
    return out


def _regenerated_record(
    tpl: ChatTemplate, raw: RawRecord, entry: dict, cfg: DataSettings
) -> Record:
    status = entry.get("status")
    if status == "cut":
        raise RecordError("regenerate_cut", entry.get("detail", "hit regenerate.max_new_tokens"))
    if status != "ok":
        raise RecordError("regenerate_failed", entry.get("detail", f"status {status!r}"))
    conv = to_conversation(entry, cfg.non_text)
    return tokenize_conversation(tpl, raw, conv, cfg)


def _table(examples: list[Example], with_prompt: list[list[int]] | None = None) -> pa.Table:
    columns = {
        "sample_id": [e.sample_id for e in examples],
        "input_ids": [e.input_ids for e in examples],
        "loss_mask": [e.loss_mask for e in examples],
    }
    if with_prompt is None:
        return pa.table(columns, schema=SHARD_SCHEMA)
    return pa.table({**columns, "prompt_ids": with_prompt}, schema=EVAL_SCHEMA)


def _samples(records: list[Record]) -> list[Example]:
    return [e for r in records for e in r.examples]


def _stats(examples: list[Example]) -> dict:
    return {
        "records": len(examples),
        "tokens": sum(len(e.input_ids) for e in examples),
        "assistant_tokens": sum(sum(e.loss_mask) for e in examples),
    }


def _sha256(path: str | Path) -> str:
    """Of a file's bytes; of a datasets folder, of its files' names and bytes in name order."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            h.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


@dataclass
class Split:
    """The usable records after the eval split: held out, and the training shards."""

    held_out: list[Record]
    shards: list[list[Record]]


def tokenize(
    target: str | Path,
    inputs: list[str | Path],
    out_dir: str | Path,
    settings: dict,
    regenerated: list[str | Path] = (),
) -> dict:
    """The whole stage: shards, eval.parquet and report.json into `out_dir`; returns the report.
    `regenerated`: the regenerate stage's files, whose versions replace the training records."""
    cfg = DataSettings.from_settings(settings)
    trust = settings.get("trust_remote_code", False)
    if not isinstance(trust, bool):
        raise DataError(f"trust_remote_code={trust!r}: must be true or false")
    if not inputs:
        raise DataError("no input files; set data.conversations")
    if cfg.regenerate and not regenerated:
        raise DataError("data.regenerate: true, but no --regenerated files were given")
    tpl = ChatTemplate.load(target, trust, cfg.chat_template_kwargs)
    traits = template_traits(tpl)
    check_mode(traits, cfg.mask_mode, str(target))
    log.info(
        "tokenizing %d file(s) with the chat template of %s (max_seq_len=%d, mask_mode=%s: %s)",
        len(inputs),
        target,
        cfg.max_seq_len,
        cfg.mask_mode,
        "prefix-stable" if traits.prefix_stable else "not prefix-stable",
    )
    tally = collect_records(tpl, inputs, cfg)
    _require_enough(tally, cfg)
    held_out, shards = split_records(tally.records, cfg, tally)
    if regenerated:
        regen = read_regenerated(regenerated)
        shards = regenerated_shards(tpl, shards, regen, cfg, tally)
    split = Split(held_out, shards)
    report = _report(target, tally, cfg, split, traits)
    report["provenance"] = provenance(settings)
    report["regenerated"] = _regenerated_summary(split, tally) if regenerated else None
    prompts = [prompt_ids(tpl, r.conv) for r in held_out]
    _write_outputs(out_dir, split, prompts, report)
    for name in ("report.json", "eval.parquet"):
        keep_last_good(Path(out_dir) / name)
    _log_summary(report, out_dir)
    _warn(report)
    return report


def _report(target, tally: Tally, cfg: DataSettings, split: Split, traits) -> dict:
    kept = [*split.held_out, *(r for shard in split.shards for r in shard)]
    modes = {m: sum(r.mode == m for r in kept) for m in ("prefix", "per_turn", "generation")}
    return {
        "target": str(target),
        "tokenizer_hash": _tokenizer_hash(target),
        "inputs": tally.per_file,
        "records_read": tally.records_read,
        "records_used": len(kept),
        "records_dropped": len(tally.dropped),
        "dropped_by_reason": tally.by_reason(),
        "dropped": tally.dropped,
        "truncated": sum(r.truncated for r in kept),
        "max_seq_len": cfg.max_seq_len,
        "masks": {
            "mask_mode": cfg.mask_mode,
            "template": traits.as_dict(),
            "records_by_mode": modes,
            "samples": sum(len(r.examples) for r in kept),
            "samples_dropped_after_truncation": sum(r.dropped_samples for r in kept),
            "train_reasoning": cfg.train_reasoning,
            "reasoning_not_rendered": sum(r.turns.get("reasoning_not_rendered", 0) for r in kept),
            "turns": {k: sum(r.turns.get(k, 0) for r in kept) for k in TURN_COUNTS},
            "dropped_by_template_rule": tally.by_rule(),
            "chat_template_kwargs": cfg.chat_template_kwargs,
            "non_text_parts_dropped": sum(r.conv.dropped_parts for r in kept),
        },
        "eval": {"file": "eval.parquet", **_stats([r.examples[0] for r in split.held_out])},
        "shards": [
            {"file": f"shard_{s:03d}.parquet", **_stats(_samples(shard))}
            for s, shard in enumerate(split.shards)
        ],
    }


def _require_enough(tally: Tally, cfg: DataSettings) -> None:
    need = cfg.num_eval + cfg.num_shards
    if len(tally.records) < need:
        fix = ", or fix the dropped records (data.strict: true names the first)"
        fix = fix if tally.dropped else ""
        cut = tally.by_reason().get("no_assistant_tokens_after_truncation", 0)
        if cut:
            fix = (
                f", or raise data.max_seq_len (now {cfg.max_seq_len}): {cut} records have no "
                f"assistant token within it{fix}"
            )
        raise DataError(
            f"only {len(tally.records)} usable records of {tally.records_read} read (dropped: "
            f"{tally.top_reasons(TOP_REASONS)}); need at least data.num_eval + data.num_shards = "
            f"{cfg.num_eval} + {cfg.num_shards} = {need}: lower data.num_eval/data.num_shards "
            f"or add conversations{fix}"
        )


def _regenerated_summary(split: Split, tally: Tally) -> dict:
    counts = tally.by_reason()
    return {
        "records_used": sum(len(shard) for shard in split.shards),
        "cut": counts.get("regenerate_cut", 0),
        "failed": counts.get("regenerate_failed", 0),
    }


def _tokenizer_hash(target: str | Path) -> str | None:
    from eyrie.arch.target import tokenizer_hash

    try:
        return tokenizer_hash(target)
    except TargetError:
        return None


def _write_outputs(out_dir: str | Path, split: Split, prompts: list[list[int]], report: dict):
    """The shards, eval.parquet and report.json, into `out_dir` at once (row counts checked)."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        for s, shard in enumerate(split.shards):
            pq.write_table(_table(_samples(shard)), tmp / f"shard_{s:03d}.parquet")
        first = [r.examples[0] for r in split.held_out]
        pq.write_table(_table(first, prompts), tmp / "eval.parquet")
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


def _warn(report: dict) -> None:
    """What the user should know although nothing failed, on the terminal (the log's stderr)."""
    masks = report["masks"]
    if masks["reasoning_not_rendered"]:
        log.warning(
            "%d assistant turn(s) carry reasoning that the chat template renders nowhere (not as "
            "the last turn, not in progress): it is not trained, as the target, prompted through "
            "this template, does not generate it; set data.chat_template_kwargs if the template "
            "has a thinking switch (e.g. {thinking: true}), or drop the field",
            masks["reasoning_not_rendered"],
        )
    if masks["turns"]["without_stop_token"]:
        log.warning(
            "%d assistant turn(s) end without a stop token: the template writes none after them "
            "and none of the target's eos tokens (%s) follows; add the token the model stops on "
            "to generation_config.json's eos_token_id",
            masks["turns"]["without_stop_token"],
            ", ".join(masks["template"]["stop_tokens"]) or "none",
        )
    for rule, n in masks["dropped_by_template_rule"].items():
        log.warning("%d record(s) dropped: the chat template's rule %s (report.json)", n, rule)
    if masks["non_text_parts_dropped"]:
        log.warning(
            "%d non-text content part(s) left out (data.non_text: keep_text)",
            masks["non_text_parts_dropped"],
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eyrie.core.runtime import settings_arg

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
        help='JSON: {"data": {max_seq_len, num_shards, num_eval, seed, strict, mask_mode, ...}, '
        '"trust_remote_code": bool}',
    )
    parser.add_argument(
        "--regenerated",
        nargs="+",
        default=[],
        help="the regenerate stage's shard files: their responses replace the training records'",
    )


def run(args: argparse.Namespace) -> int:
    tokenize(args.target, args.inputs, args.out_dir, args.settings, args.regenerated)
    return 0
