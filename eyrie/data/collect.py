"""The usable records of the conversation files, tokenized: what the tokenize stage collects.

`collect_records` reads every input in order and tokenizes each record into its samples
(eyrie.chat.samples), counting the unusable ones by reason in a `Tally` (data.strict: the first
stops the stage); `split_records` holds out the eval records and cuts the rest into shards;
`regenerated_shards` puts the regenerate stage's responses in place of the training records'.
docs/data.md.
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

from eyrie.chat.inputs import read_records
from eyrie.chat.records import (
    REASONS,
    Conversation,
    RawRecord,
    RecordError,
    to_conversation,
)
from eyrie.chat.samples import masked_samples
from eyrie.chat.template import ChatTemplate
from eyrie.config.stages import DataSettings
from eyrie.core.errors import DataError
from eyrie.core.jsonlines import read_json_lines

log = logging.getLogger(__name__)


LOG_EVERY = 5000


# listed in dropped_by_reason only when they occur, so that reports of clean inputs keep their keys
LISTED_WHEN_SEEN = (
    "bad_encoding",
    "record_too_large",
    "too_deep",
    "too_many_turns",
    "bad_tool_calls",
    "duplicate",
    "shares_eval_prompt",
    "regenerate_cut",
    "regenerate_failed",
    "template_rule",
)


TOP_REASONS = 3  # reasons named in the "too few usable records" error


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
    turns: dict = field(default_factory=dict)  # eyrie.chat.samples.TURN_COUNTS

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

    def cut_fix(self, max_seq_len: int) -> str:
        """ ", or raise data.max_seq_len ..." when records were dropped for having no assistant
        token within it (the fix a user needs when max_seq_len is too small), else ""."""
        cut = self.by_reason().get("no_assistant_tokens_after_truncation", 0)
        if not cut:
            return ""
        return (
            f", or raise data.max_seq_len (now {max_seq_len}): {cut} records have no assistant "
            "token within it"
        )

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
        _require_some(path, read, used, tally, cfg.max_seq_len)
    return tally


def _require_some(path, read: int, used: int, tally: Tally, max_seq_len: int) -> None:
    """A file none of whose records is usable (an unknown schema, say) stops the stage: its
    counts in report.json alone would train silently without it. Copies of conversations
    already read (a file listed twice) are not a mistake. Records cut to nothing by
    data.max_seq_len are the setting's to fix, not the file's."""
    if not read or used:
        return
    own = Tally(dropped=[d for d in tally.dropped if d["file"] == str(path)])
    if all(d["reason"] == "duplicate" for d in own.dropped):
        return
    raise DataError(
        f"{path}: none of its {read} records is usable ({own.top_reasons(TOP_REASONS)}); fix "
        "the file (docs/data.md#input-files gives the formats read) or remove it from "
        f"data.conversations{own.cut_fix(max_seq_len)}"
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
        for lineno, entry in read_json_lines(path, _not_regenerated):
            try:
                out[entry["sample_id"]] = entry
            except (KeyError, TypeError) as exc:
                raise _not_regenerated(f"{path}:{lineno}", exc) from exc
    return out


def _not_regenerated(where: str, exc: Exception) -> DataError:
    return DataError(
        f"{where}: not a regenerated record ({type(exc).__name__}); delete the file to "
        "regenerate it"
    )


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
    conv.generated = _generated_ids(entry.get("generated"), raw)
    return tokenize_conversation(tpl, raw, conv, cfg)


def _generated_ids(value: object, raw: RawRecord) -> dict:
    """A regenerated line's exact ids per turn ({} for lines written before they were kept)."""
    if value is None:
        return {}
    try:
        return {
            int(turn): {"ids": [int(i) for i in entry["ids"]], "prompt": str(entry["prompt"])}
            for turn, entry in value.items()
        }
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise _not_regenerated(raw.sample_id, exc) from exc


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
