"""Conversation files -> records -> normalized messages, and why a record cannot be used.

`read_records` yields the records of one `.jsonl`, `.json` or `.parquet` file, each named
`"<file>:<line>"` (a `.jsonl` line that is not UTF-8 or not JSON carries its RecordError; a
leading byte-order mark is skipped); `to_messages` turns an OpenAI- or ShareGPT-form record into
`[{"role", "content"}]`, joining content-part lists whose parts are all text. A file that cannot
be read raises DataError; a record that cannot be used raises (or carries) RecordError with a
reason from REASONS. docs/data.md#input-files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from eyrie.errors import DataError, EyrieError

# reason -> what the user can do about it
REASONS = {
    "bad_encoding": "re-encode the file as UTF-8",
    "bad_json": "fix the JSON syntax of that record",
    "unknown_format": (
        'use OpenAI form {"messages": [{"role": ..., "content": ...}]} or ShareGPT '
        'form {"conversations": [{"from": ..., "value": ...}]}'
    ),
    "unknown_role": "use roles system/user/assistant (ShareGPT: system/human/gpt)",
    "no_assistant_turn": "add an assistant turn (only assistant tokens are trained on)",
    "empty_content": "give every turn non-empty text, or remove the empty turn",
    "non_text_content": (
        'keep only text parts ({"type": "text", "text": ...}) or flatten the content to a '
        "plain string (image, audio and other parts are not supported)"
    ),
    "template_error": (
        "the target's chat template failed or is not prefix-stable for this "
        "conversation; fix the conversation or use a prefix-stable template"
    ),
    "no_assistant_tokens_after_truncation": "raise data.max_seq_len or shorten the conversation",
}


OPENAI_ROLES = ("system", "user", "assistant")


SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


SUFFIXES = (".jsonl", ".json", ".parquet")


DETAIL_CHARS = 160


class RecordError(EyrieError):
    """One record cannot be used; `reason` is a key of REASONS."""

    def __init__(self, reason: str, detail: str):
        assert reason in REASONS, reason
        self.reason = reason
        self.detail = _one_line(detail)
        super().__init__(f"{reason}: {self.detail}")


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 3] + "..."


@dataclass
class RawRecord:
    file: str
    line: int  # 1-based line (.jsonl) or 0-based record index (.json, .parquet)
    obj: object = None
    error: RecordError | None = None

    @property
    def sample_id(self) -> str:
        return f"{self.file}:{self.line}"


def read_records(path: str | Path) -> Iterator[RawRecord]:
    """Yield the records of one input file; a record that is not valid JSON carries its error."""
    path = Path(path)
    name = str(path)
    if not path.is_file():
        raise DataError(f"{name}: input file not found; fix data.conversations")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl_records(path)
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8-sig"))
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{name}: not UTF-8 ({_bad_byte(exc)}); {REASONS['bad_encoding']}"
            ) from exc
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{name}: not valid JSON ({exc}); a .json input must be one list of "
                "records (use .jsonl for one record per line)"
            ) from exc
        if not isinstance(data, list):
            raise DataError(
                f"{name}: top level is {type(data).__name__}, expected a list of records; "
                "wrap the records in [...] or use .jsonl"
            )
        for index, obj in enumerate(data):
            yield RawRecord(name, index, obj)
    elif suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{name}: cannot read as Parquet ({_one_line(exc)})") from exc
        for index, row in enumerate(table.to_pylist()):
            # a column absent from this row's form reads back as null
            yield RawRecord(name, index, {k: v for k, v in row.items() if v is not None})
    else:
        raise DataError(
            f"{name}: unsupported file type {path.suffix!r}; use one of {', '.join(SUFFIXES)}"
        )


def _jsonl_lines(path: Path) -> Iterator[bytes]:
    """The lines of a file as bytes, as text mode gives them: split at LF, CRLF or a lone CR,
    each kept line end written as LF (JSON error positions count it)."""
    with path.open("rb") as f:
        for chunk in f:
            for line in chunk.splitlines(keepends=True):
                body = line.rstrip(b"\r\n")
                yield body + b"\n" if len(body) < len(line) else body


def _jsonl_records(path: Path) -> Iterator[RawRecord]:
    name = str(path)
    for lineno, data in enumerate(_jsonl_lines(path), start=1):
        try:
            text = data.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            yield RawRecord(name, lineno, error=RecordError("bad_encoding", _bad_byte(exc)))
            continue
        if not text.strip():
            continue
        try:
            yield RawRecord(name, lineno, json.loads(text))
        except json.JSONDecodeError as exc:
            yield RawRecord(name, lineno, error=RecordError("bad_json", str(exc)))


def _bad_byte(exc: UnicodeDecodeError) -> str:
    return f"byte 0x{exc.object[exc.start]:02x} at byte offset {exc.start} is not valid UTF-8"


def _text_content(content: object, where: str) -> object:
    """A content-part list whose parts are all text, joined with ""; any other content as is."""
    if not isinstance(content, list):
        return content
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RecordError(
                "non_text_content",
                f"{where}[{j}] is a {kind!r} part; only text parts are supported",
            )
    return "".join(part["text"] for part in content)


def to_messages(obj: object) -> list[dict]:
    """An OpenAI- or ShareGPT-form record as `[{"role", "content"}]`; RecordError if unusable."""
    if not isinstance(obj, dict):
        raise RecordError("unknown_format", f"record is a JSON {type(obj).__name__}, not an object")
    if "messages" in obj:
        turns, role_key, text_key, roles = (
            obj["messages"],
            "role",
            "content",
            {r: r for r in OPENAI_ROLES},
        )
    elif "conversations" in obj:
        turns, role_key, text_key, roles = obj["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise RecordError(
            "unknown_format", f"no 'messages' or 'conversations' key (keys: {sorted(obj)[:8]})"
        )
    form = "messages" if role_key == "role" else "conversations"
    if not isinstance(turns, list) or not turns:
        raise RecordError("unknown_format", f"'{form}' must be a non-empty list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise RecordError(
                "unknown_format",
                f"{form}[{i}] must be an object with '{role_key}' and '{text_key}'",
            )
        role = turn[role_key]
        if role not in roles:
            raise RecordError(
                "unknown_role", f"{form}[{i}].{role_key}={role!r}; allowed: {', '.join(roles)}"
            )
        content = _text_content(turn[text_key], f"{form}[{i}].{text_key}")
        if content is None or (isinstance(content, str) and not content.strip()):
            raise RecordError("empty_content", f"{form}[{i}] ({roles[role]}) has no text")
        if not isinstance(content, str):
            raise RecordError(
                "non_text_content", f"{form}[{i}].{text_key} is a {type(content).__name__}"
            )
        messages.append({"role": roles[role], "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no_assistant_turn", f"roles are {[m['role'] for m in messages]}")
    return messages
