"""Conversations -> tokenized shards with assistant-only loss masks, and a held-out eval split.

`eyrie tokenize --target DIR --inputs F [F ...] --out-dir DIR --settings JSON`

Inputs are `.jsonl`, `.json` or `.parquet` files of OpenAI- or ShareGPT-form records, read and
normalized by `eyrie.records` (which documents the file types, record forms and `"<file>:<line>"`
record names).

The loss mask comes from prefix rendering with the target's own chat template: for assistant turn
i, `render(messages[:i], add_generation_prompt=True)` and `render(messages[:i+1])` must both be
string prefixes of the whole rendering; the characters between them, less trailing whitespace
the template writes after the turn's end token, are the assistant span (content and end token). Tokens whose character span starts inside an assistant span
get mask 1. A template for which this does not hold (not prefix-stable) gives `template_error`.

Unusable records are never dropped silently: each is counted by reason and listed with its
`file:line` in report.json, or, with `data.strict: true`, the first one stops the stage with one
line naming it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eyrie.io import atomic_path, provenance
from eyrie.records import REASONS, DataError, RawRecord, RecordError, _one_line, read_records, to_messages

log = logging.getLogger(__name__)
LOG_EVERY = 5000

SHARD_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.uint8())),
])
EVAL_SCHEMA = SHARD_SCHEMA.append(pa.field("prompt_ids", pa.list_(pa.int32())))


# ----------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class DataSettings:
    max_seq_len: int
    num_shards: int
    num_eval: int
    seed: int
    strict: bool

    @classmethod
    def from_settings(cls, settings: dict) -> "DataSettings":
        data = settings.get("data")
        if not isinstance(data, dict):
            raise DataError("settings: missing object 'data'; pass --settings '{\"data\": {...}}'")
        values = {}
        for key, kind, low in (("max_seq_len", int, 1), ("num_shards", int, 1), ("num_eval", int, 0),
                               ("seed", int, None), ("strict", bool, None)):
            if key not in data:
                raise DataError(f"settings: missing data.{key}; set it in the config's data section")
            value = data[key]
            if type(value) is not kind or (low is not None and value < low):
                want = "true or false" if kind is bool else f"an integer >= {low}" if low is not None else "an integer"
                raise DataError(f"data.{key}={value!r}: must be {want}")
            values[key] = value
        return cls(**values)


# ----------------------------------------------------------------------------- rendering

def load_chat_tokenizer(target: str | Path, trust_remote_code: bool = False):
    """The target's tokenizer; refuse one without a chat template."""
    from transformers import AutoTokenizer

    target = Path(target)
    if not target.is_dir():
        raise DataError(f"{target}: target folder not found; set target.path to a Hugging Face model folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        hint = "" if trust_remote_code else " (set trust_remote_code: true if it ships tokenizer code you trust)"
        raise DataError(f"{target}: cannot load the tokenizer: {_one_line(exc)}{hint}") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{target}: the tokenizer has no chat template; add chat_template.jinja (or "
                        "'chat_template' in tokenizer_config.json) to the target folder")
    return tokenizer


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template's text for `messages` (may be empty: then only what precedes turns)."""
    try:
        if messages:
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        # apply_chat_template refuses an empty conversation; render the same template directly
        # (needed for the prompt of a conversation that opens with an assistant turn).
        from transformers.utils.chat_template_utils import render_jinja_template

        texts, _ = render_jinja_template(conversations=[[]], chat_template=tokenizer.get_chat_template(),
                                         add_generation_prompt=add_generation_prompt,
                                         **tokenizer.special_tokens_map)
        return texts[0]
    except Exception as exc:  # jinja errors and raise_exception() in templates have many types
        raise RecordError("template_error", f"rendering {len(messages)} messages failed: "
                                            f"{type(exc).__name__}: {exc}") from exc


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character span of every assistant turn in it."""
    full = render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1])
        if not (full.startswith(before) and full.startswith(upto) and len(before) < len(upto)):
            which = "the prompt before" if not full.startswith(before) else "the conversation up to"
            raise RecordError("template_error", f"not prefix-stable: {which} assistant turn {i} is not a "
                                                "prefix of the whole rendering")
        # Whitespace the template writes after the turn's end token (Qwen's "<|im_end|>\n") is
        # not generated by the model, which stops at the end token: it stays outside the span.
        start = len(before)
        spans.append((start, start + len(full[start: len(upto)].rstrip())))
    return full, spans


def _encode_with_offsets(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Token ids of `text` and, per token, 1 when the token starts inside one of `spans`."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        ids = list(enc["input_ids"])
        starts = [start for start, _ in enc["offset_mapping"]]
        mask, k = [], 0
        for start in starts:  # spans are sorted and disjoint; starts are non-decreasing
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            mask.append(int(k < len(spans) and spans[k][0] <= start))
        return ids, mask
    # Slow tokenizers (e.g. tiktoken-based remote code) have no offsets: tokenize the pieces
    # between span boundaries and accept the result only if it equals the whole-text tokenization.
    ids, mask, pos = [], [], 0
    for a, b in spans:
        for piece, bit in ((text[pos:a], 0), (text[a:b], 1)):
            piece_ids = tokenizer.encode(piece, add_special_tokens=False) if piece else []
            ids += piece_ids
            mask += [bit] * len(piece_ids)
        pos = b
    tail = tokenizer.encode(text[pos:], add_special_tokens=False) if text[pos:] else []
    ids += tail
    mask += [0] * len(tail)
    if ids != list(tokenizer.encode(text, add_special_tokens=False)):
        raise RecordError("template_error", "tokenizer gives no offsets and a token crosses an assistant "
                                            "span boundary; use a fast tokenizer (tokenizer.json)")
    return ids, mask


def render_with_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and its assistant-only loss mask (same length).

    `messages`: `[{"role": "system"|"user"|"assistant", "content": str}, ...]`. The mask is 1 on
    tokens starting inside an assistant turn's span (content and end-of-turn token). Not truncated.
    Raises RecordError("template_error") when the template is not prefix-stable.
    """
    full, spans = assistant_spans(tokenizer, messages)
    return _encode_with_offsets(tokenizer, full, spans)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The messages before the first assistant turn, rendered with the generation prompt."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    text = render(tokenizer, messages[:first], add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


# ----------------------------------------------------------------------------- the stage

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
        counts = dict.fromkeys(REASONS, 0)
        for d in self.dropped:
            counts[d["reason"]] += 1
        return counts


def tokenize_record(tokenizer, raw: RawRecord, max_seq_len: int) -> tuple[Example, bool]:
    """One record -> (example truncated to max_seq_len, whether it was truncated); RecordError if unusable."""
    if raw.error is not None:
        raise raw.error
    messages = to_messages(raw.obj)
    ids, mask = render_with_mask(tokenizer, messages)
    truncated = len(ids) > max_seq_len
    ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    if not any(mask):
        raise RecordError("no_assistant_tokens_after_truncation",
                          f"the first assistant token is beyond max_seq_len={max_seq_len}")
    return Example(raw.sample_id, ids, mask, messages), truncated


def collect_examples(tokenizer, inputs: list[str | Path], max_seq_len: int,
                     strict: bool) -> tuple[list[Example], Tally]:
    """Read and tokenize every record of `inputs`, in order; count (or, strict, raise on) unusable ones."""
    missing = [str(p) for p in inputs if not Path(p).is_file()]
    if missing:
        raise DataError(f"{missing[0]}: input file not found"
                        f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; fix data.conversations")
    examples, tally = [], Tally()
    for path in inputs:
        read_before, used_before = tally.records_read, len(examples)
        for raw in read_records(path):
            tally.records_read += 1
            try:
                example, truncated = tokenize_record(tokenizer, raw, max_seq_len)
            except RecordError as err:
                if strict:
                    raise DataError(f"{raw.sample_id}: {err.reason}: {err.detail}; {REASONS[err.reason]} "
                                    "(or set data.strict: false to count and skip such records)") from err
                tally.dropped.append({"file": raw.file, "line": raw.line, "reason": err.reason,
                                      "detail": err.detail})
                continue
            examples.append(example)
            tally.truncated += truncated
            if tally.records_read % LOG_EVERY == 0:
                log.info("%d records read, %d usable", tally.records_read, len(examples))
        tally.per_file[str(path)] = {"records_read": tally.records_read - read_before,
                                     "records_used": len(examples) - used_before,
                                     "sha256": _sha256(path)}
        log.info("%s: %d records, %d usable", path, tally.records_read - read_before,
                 len(examples) - used_before)
    return examples, tally


def split_examples(examples: list[Example], num_eval: int, num_shards: int,
                   seed: int) -> tuple[list[Example], list[list[Example]]]:
    """Shuffle with `seed`; the first num_eval are eval, the rest dealt into contiguous near-equal shards."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    shuffled = [examples[i] for i in order]
    held_out, rest = shuffled[:num_eval], shuffled[num_eval:]
    base, extra = divmod(len(rest), num_shards)
    shards, pos = [], 0
    for s in range(num_shards):
        size = base + (s < extra)
        shards.append(rest[pos: pos + size])
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
    return {"records": len(examples), "tokens": sum(len(e.input_ids) for e in examples),
            "assistant_tokens": sum(sum(e.loss_mask) for e in examples)}


def _sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def tokenize(target: str | Path, inputs: list[str | Path], out_dir: str | Path, settings: dict) -> dict:
    """The whole stage: write shards, eval.parquet and report.json into `out_dir`; return the report."""
    cfg = DataSettings.from_settings(settings)
    trust = settings.get("trust_remote_code", False)
    if not isinstance(trust, bool):
        raise DataError(f"trust_remote_code={trust!r}: must be true or false")
    if not inputs:
        raise DataError("no input files; set data.conversations")
    tokenizer = load_chat_tokenizer(target, trust)
    log.info("tokenizing %d file(s) with the chat template of %s (max_seq_len=%d)",
             len(inputs), target, cfg.max_seq_len)
    examples, tally = collect_examples(tokenizer, inputs, cfg.max_seq_len, cfg.strict)

    need = cfg.num_eval + cfg.num_shards
    if len(examples) < need:
        dropped = {k: v for k, v in tally.by_reason().items() if v}
        raise DataError(f"only {len(examples)} usable records of {tally.records_read} read (dropped: "
                        f"{dropped or 'none'}); need at least data.num_eval + data.num_shards = "
                        f"{cfg.num_eval} + {cfg.num_shards} = {need}: lower data.num_eval/data.num_shards "
                        "or add conversations")
    held_out, shards = split_examples(examples, cfg.num_eval, cfg.num_shards, cfg.seed)
    prompts = [prompt_ids(tokenizer, e.messages) for e in held_out]

    from eyrie.targets import TargetError, tokenizer_hash
    try:
        tok_hash = tokenizer_hash(target)
    except TargetError:
        tok_hash = None
    report = {
        "target": str(target),
        "tokenizer_hash": tok_hash,
        "inputs": tally.per_file,
        "records_read": tally.records_read,
        "records_used": len(examples),
        "records_dropped": len(tally.dropped),
        "dropped_by_reason": tally.by_reason(),
        "dropped": tally.dropped,
        "truncated": tally.truncated,
        "max_seq_len": cfg.max_seq_len,
        "eval": {"file": "eval.parquet", **_stats(held_out)},
        "shards": [{"file": f"shard_{s:03d}.parquet", **_stats(shard)} for s, shard in enumerate(shards)],
        "provenance": provenance(settings),
    }
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        for s, shard in enumerate(shards):
            pq.write_table(_table(shard), tmp / f"shard_{s:03d}.parquet")
        pq.write_table(_table(held_out, prompts), tmp / "eval.parquet")
        for entry in [*report["shards"], report["eval"]]:  # validate before the rename
            rows = pq.read_metadata(tmp / entry["file"]).num_rows
            assert rows == entry["records"], (entry["file"], rows, entry["records"])
        (tmp / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    log.info("%d records read, %d used (%d eval, %d in %d shards), %d dropped %s, %d truncated -> %s",
             tally.records_read, len(examples), len(held_out), len(examples) - len(held_out),
             cfg.num_shards, len(tally.dropped), {k: v for k, v in tally.by_reason().items() if v},
             tally.truncated, out_dir)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eyrie.cli import settings_arg

    parser.add_argument("--target", required=True, help="Hugging Face model folder with the tokenizer")
    parser.add_argument("--inputs", required=True, nargs="+", help="conversation files (.jsonl/.json/.parquet)")
    parser.add_argument("--out-dir", required=True, help="folder for shard_NNN.parquet, eval.parquet, report.json")
    parser.add_argument("--settings", required=True, type=settings_arg,
                        help='JSON: {"data": {max_seq_len, num_shards, num_eval, seed, strict}, '
                             '"trust_remote_code": bool}')


def run(args: argparse.Namespace) -> int:
    tokenize(args.target, args.inputs, args.out_dir, args.settings)
    return 0
