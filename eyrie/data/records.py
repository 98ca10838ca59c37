"""Conversation files -> records -> conversations as the chat template sees them.

`read_records` yields the records of one input (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`, `.json`,
`.parquet`, or a folder written by `datasets`' `save_to_disk`), each named `"<file>:<line>"`; a
`.jsonl` line that is not UTF-8, not JSON or too large carries its RecordError and costs that
record only. `to_conversation` turns an OpenAI- or ShareGPT-form record into a `Conversation`:
messages with their reasoning, tool calls and tool results, and the record's tool definitions.
A file that cannot be read raises DataError; a record that cannot be used raises (or carries)
RecordError with a reason from REASONS. docs/data.md#input-files.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from eyrie.errors import DataError, EyrieError

# reason -> what the user can do about it
REASONS = {
    "bad_encoding": "re-encode the file as UTF-8",
    "bad_json": "fix the JSON syntax of that record",
    "record_too_large": "split the record (a .jsonl line may hold at most 64 MiB)",
    "unknown_format": (
        'use OpenAI form {"messages": [{"role": ..., "content": ...}]} or ShareGPT '
        'form {"conversations": [{"from": ..., "value": ...}]}'
    ),
    "unknown_role": "use roles system/user/assistant/tool (ShareGPT: system/human/gpt/tool)",
    "no_assistant_turn": "add an assistant turn (only assistant tokens are trained on)",
    "empty_content": "give every turn non-empty text (or an assistant turn tool_calls)",
    "bad_tool_calls": (
        'give tool_calls as a list of {"type": "function", "function": {"name": ..., '
        '"arguments": ...}} and tools as a list of objects'
    ),
    "non_text_content": (
        "keep only text parts, or set data.non_text: keep_text to train on the text parts "
        "of records that also hold images, audio or other parts"
    ),
    "duplicate": "nothing: the first copy of the conversation is kept",
    "shares_eval_prompt": (
        "nothing: a training record whose prompt is a held-out eval prompt would inflate "
        "the measured acceptance length"
    ),
    "template_error": (
        "the target's chat template failed for this conversation, or (data.mask_mode: prefix) "
        "is not prefix-stable for it; fix the conversation or use data.mask_mode: auto"
    ),
    "no_assistant_tokens_after_truncation": "raise data.max_seq_len or shorten the conversation",
    "regenerate_cut": "raise regenerate.max_new_tokens (the response hit the length limit)",
    "regenerate_failed": "see the regenerate job's log for why generation failed",
}


OPENAI_ROLES = ("system", "user", "assistant", "tool")


SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "gpt": "assistant",
    "tool": "tool",
    "observation": "tool",
}


# the fields of an input message the template sees, beside role and content
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")  # first present wins
PASSED_FIELDS = ("tool_calls", "tool_call_id", "name")


SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".parquet")


DETAIL_CHARS = 160


MAX_RECORD_BYTES = 64 << 20  # a longer .jsonl line is skipped (record_too_large), never read


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
    line: int  # 1-based line (.jsonl) or 0-based record index (.json, .parquet, datasets)
    obj: object = None
    error: RecordError | None = None

    @property
    def sample_id(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class Conversation:
    """Messages as the template sees them, the record's tool definitions, and what was left out.

    A message has `role` and `content` (a string; "" for an assistant turn that only calls
    tools) and, when the record gives them, `reasoning_content`, `tool_calls`, `tool_call_id`
    and `name`. `dropped_parts` counts non-text content parts left out (data.non_text: keep_text).
    """

    messages: list[dict]
    tools: list[dict] | None = None
    dropped_parts: int = field(default=0, compare=False)

    def key(self) -> str:
        """Content hash: two records with the same messages and tools are one conversation."""
        text = json.dumps([self.messages, self.tools], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    def prompt_key(self) -> str:
        """Hash of what precedes the first assistant turn (the prompt an evaluation decodes)."""
        first = next(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        text = json.dumps([self.messages[:first], self.tools], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    def to_record(self) -> dict:
        """The conversation as an OpenAI-form record (`to_conversation` reads it back equal)."""
        record = {"messages": self.messages}
        if self.tools is not None:
            record["tools"] = self.tools
        return record


# ----------------------------------------------------------------------------- reading files


def input_kind(path: str | Path) -> str | None:
    """The input type of `path` (a suffix of SUFFIXES, or "datasets"); None if unsupported."""
    path = Path(path)
    if path.is_dir():
        return "datasets"
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def read_records(path: str | Path) -> Iterator[RawRecord]:
    """Yield the records of one input; a record that is not valid JSON carries its error."""
    path = Path(path)
    name = str(path)
    if not path.exists():
        raise DataError(f"{name}: input file not found; fix data.conversations")
    kind = input_kind(path)
    if kind in (".jsonl", ".jsonl.gz", ".jsonl.zst"):
        yield from _jsonl_records(path, kind)
    elif kind == ".json":
        yield from _json_records(path)
    elif kind == ".parquet":
        yield from _table_records(name, _parquet_tables(path))
    elif kind == "datasets":
        yield from _table_records(name, _datasets_tables(path))
    else:
        raise DataError(
            f"{name}: unsupported file type; use one of {', '.join(SUFFIXES)} or a folder "
            "written by datasets' save_to_disk"
        )


def _json_records(path: Path) -> Iterator[RawRecord]:
    name = str(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{name}: not UTF-8 ({_bad_byte(exc)}); {REASONS['bad_encoding']}") from exc
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


def _table_records(name: str, tables: Iterator[pa.Table]) -> Iterator[RawRecord]:
    index = 0
    for table in tables:
        for batch in table.to_batches(max_chunksize=1024):  # a batch at a time: bounded memory
            for row in batch.to_pylist():
                # a column absent from this row's form reads back as null
                yield RawRecord(name, index, {k: v for k, v in row.items() if v is not None})
                index += 1


def _parquet_tables(path: Path) -> Iterator[pa.Table]:
    """A Parquet file a batch of rows at a time (bounded memory)."""
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield pa.Table.from_batches([batch])
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: cannot read as Parquet ({_one_line(exc)})") from exc


def _datasets_tables(path: Path) -> Iterator[pa.Table]:
    """The Arrow files of a `save_to_disk` folder, in state.json's order, memory-mapped."""
    state = path / "state.json"
    if not state.is_file():
        splits = path / "dataset_dict.json"
        if splits.is_file():
            names = json.loads(splits.read_text()).get("splits", [])
            raise DataError(
                f"{path}: a DatasetDict folder (splits {', '.join(names)}); name one split's "
                f"folder in data.conversations, e.g. {path / (names[0] if names else 'train')}"
            )
        raise DataError(
            f"{path}: a folder without state.json; give a conversations file or a folder "
            "written by datasets' save_to_disk"
        )
    try:
        files = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{state}: not a datasets state.json ({_one_line(exc)})") from exc
    for filename in files:
        try:
            with pa.memory_map(str(path / filename)) as source:
                yield pa.ipc.open_stream(source).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{path / filename}: cannot read as Arrow ({_one_line(exc)})") from exc


def _open_binary(path: Path, kind: str) -> IO[bytes]:
    if kind == ".jsonl.gz":
        return gzip.open(path, "rb")
    if kind == ".jsonl.zst":
        return pa.CompressedInputStream(pa.OSFile(str(path), "rb"), "zstd")
    return path.open("rb")


def _jsonl_lines(path: Path, kind: str) -> Iterator[bytes | None]:
    """The lines of a file as bytes, as text mode gives them: split at LF, CRLF or a lone CR,
    each kept line end written as LF (JSON error positions count it). A line longer than
    MAX_RECORD_BYTES is skipped without being held and yields None in its place."""
    with _open_binary(path, kind) as f:
        reader = _LineReader(f)
        while (line := reader.readline(MAX_RECORD_BYTES + 1)) is not None:
            if len(line) > MAX_RECORD_BYTES and not line.endswith(b"\n"):
                reader.skip_line()
                yield None
                continue
            for part in line.splitlines(keepends=True):  # a lone CR ends a line too
                body = part.rstrip(b"\r\n")
                yield body + b"\n" if len(body) < len(part) else body


class _LineReader:
    """readline(limit) over any binary stream (gzip, zstd and plain files alike), buffered."""

    BLOCK = 1 << 20

    def __init__(self, f: IO[bytes]):
        self.f, self.buf, self.eof = f, b"", False

    def _fill(self) -> bool:
        if self.eof:
            return False
        block = self.f.read(self.BLOCK)
        self.eof = not block
        self.buf += block
        return bool(block)

    def readline(self, limit: int) -> bytes | None:
        while True:
            end = self.buf.find(b"\n", 0, limit)
            if end >= 0:
                line, self.buf = self.buf[: end + 1], self.buf[end + 1 :]
                return line
            if len(self.buf) >= limit or not self._fill():
                if not self.buf:
                    return None
                line, self.buf = self.buf[:limit], self.buf[limit:]
                return line

    def skip_line(self) -> None:
        while True:
            end = self.buf.find(b"\n")
            if end >= 0:
                self.buf = self.buf[end + 1 :]
                return
            self.buf = b""
            if not self._fill():
                return


def _jsonl_records(path: Path, kind: str) -> Iterator[RawRecord]:
    name = str(path)
    for lineno, data in enumerate(_jsonl_lines(path, kind), start=1):
        if data is None:
            error = RecordError("record_too_large", f"line is longer than {MAX_RECORD_BYTES} bytes")
            yield RawRecord(name, lineno, error=error)
            continue
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


# ----------------------------------------------------------------------------- records


def _text_content(content: object, where: str, keep_text: bool) -> tuple[object, int]:
    """A content-part list as its text parts joined with "" and the number of other parts
    (refused unless keep_text); any other content as is."""
    if not isinstance(content, list):
        return content, 0
    texts, dropped = [], 0
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif keep_text:
            dropped += 1
        else:
            raise RecordError(
                "non_text_content",
                f"{where}[{j}] is a {kind!r} part; only text parts are supported",
            )
    return "".join(texts), dropped


def _tool_calls(calls: object, where: str) -> list[dict]:
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("function", c), dict) for c in calls
    ):
        raise RecordError("bad_tool_calls", f"{where} must be a list of tool-call objects")
    for k, call in enumerate(calls):
        function = call.get("function", call)
        if not isinstance(function.get("name"), str):
            raise RecordError("bad_tool_calls", f"{where}[{k}] has no function name")
    return calls


@dataclass(frozen=True)
class _Form:
    """A record form: its list key, the role and text keys of a turn, and its roles."""

    name: str
    role_key: str
    text_key: str
    roles: dict


FORMS = (
    _Form("messages", "role", "content", {r: r for r in OPENAI_ROLES}),
    _Form("conversations", "from", "value", SHAREGPT_ROLES),
)


def _message(turn: dict, i: int, fm: _Form, keep_text: bool) -> tuple[dict, int]:
    """One turn as the template sees it, and how many non-text parts it lost."""
    form, role_key, text_key, roles = fm.name, fm.role_key, fm.text_key, fm.roles
    role = turn[role_key]
    if role not in roles:
        raise RecordError(
            "unknown_role", f"{form}[{i}].{role_key}={role!r}; allowed: {', '.join(roles)}"
        )
    role = roles[role]
    content, dropped = _text_content(turn.get(text_key), f"{form}[{i}].{text_key}", keep_text)
    if content is not None and not isinstance(content, str):
        raise RecordError(
            "non_text_content", f"{form}[{i}].{text_key} is a {type(content).__name__}"
        )
    message = {"role": role, "content": content or ""}
    reasoning = next((turn[f] for f in REASONING_FIELDS if turn.get(f) is not None), None)
    if reasoning is not None and role == "assistant":
        if not isinstance(reasoning, str):
            raise RecordError(
                "non_text_content", f"{form}[{i}] reasoning is a {type(reasoning).__name__}"
            )
        if reasoning.strip():
            message["reasoning_content"] = reasoning
    for name in PASSED_FIELDS:
        if turn.get(name) is not None:
            message[name] = turn[name]
    if "tool_calls" in message:
        if role != "assistant":
            raise RecordError("bad_tool_calls", f"{form}[{i}] ({role}) has tool_calls")
        message["tool_calls"] = _tool_calls(message["tool_calls"], f"{form}[{i}].tool_calls")
    if not message["content"].strip() and not message.get("tool_calls"):
        raise RecordError("empty_content", f"{form}[{i}] ({role}) has no text")
    return message, dropped


def to_conversation(obj: object, non_text: str = "drop") -> Conversation:
    """An OpenAI- or ShareGPT-form record as a Conversation; RecordError if unusable.

    `non_text`: "drop" refuses a record with non-text content parts (non_text_content);
    "keep_text" keeps the record with its text parts and counts the others.
    """
    if not isinstance(obj, dict):
        raise RecordError("unknown_format", f"record is a JSON {type(obj).__name__}, not an object")
    fm = next((f for f in FORMS if f.name in obj), None)
    if fm is None:
        raise RecordError(
            "unknown_format", f"no 'messages' or 'conversations' key (keys: {sorted(obj)[:8]})"
        )
    form, keys = fm.name, (fm.role_key, fm.text_key)
    turns = obj[form]
    if not isinstance(turns, list) or not turns:
        raise RecordError("unknown_format", f"'{form}' must be a non-empty list")
    messages, dropped = [], 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or keys[0] not in turn:
            raise RecordError(
                "unknown_format", f"{form}[{i}] must be an object with '{keys[0]}' and '{keys[1]}'"
            )
        if keys[1] not in turn and not turn.get("tool_calls"):
            raise RecordError(
                "unknown_format", f"{form}[{i}] must be an object with '{keys[0]}' and '{keys[1]}'"
            )
        message, lost = _message(turn, i, fm, non_text == "keep_text")
        messages.append(message)
        dropped += lost
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no_assistant_turn", f"roles are {[m['role'] for m in messages]}")
    tools = obj.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise RecordError("bad_tool_calls", "'tools' must be a list of tool-definition objects")
    return Conversation(messages, tools or None, dropped)


def to_messages(obj: object) -> list[dict]:
    """The messages of a record (`to_conversation(obj).messages`)."""
    return to_conversation(obj).messages
