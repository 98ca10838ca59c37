"""Conversation inputs -> raw records, each named `"<file>:<line>"`.

`read_records` yields the records of one input: `.jsonl`, `.jsonl.gz`, `.jsonl.zst`, `.json`,
`.parquet`, or a folder written by `datasets`' `save_to_disk` (Arrow files, memory-mapped), a
batch of rows at a time where the format allows. A `.jsonl` line that is not UTF-8, not JSON or
larger than MAX_RECORD_BYTES carries its RecordError and costs that record only; an input that
cannot be read raises DataError. docs/data.md#input-files.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import IO, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from eyrie.chat.records import REASONS, RawRecord, RecordError, _one_line
from eyrie.core.errors import DataError

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".parquet")


MAX_RECORD_BYTES = 64 << 20  # a longer .jsonl line is skipped (record_too_large), never read


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
    except RecursionError:
        raise DataError(
            f"{name}: arrays and objects nest too deep for a JSON reader; "
            f"{REASONS['too_deep']} (or use .jsonl, where such a record costs itself only)"
        ) from None
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
                yield RawRecord(name, index, without_nulls(row))
                index += 1


def without_nulls(value: object) -> object:
    """A row as the record had it: Arrow gives every row every field of a column's (struct)
    type, null where the record had no such key, so a null field of an object is left out at
    every depth (a null list element is kept: Arrow adds none)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


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
    lineno = 0
    try:
        for lineno, data in enumerate(_jsonl_lines(path, kind), start=1):
            yield from _jsonl_record(name, lineno, data)
    except (EOFError, gzip.BadGzipFile, zlib.error, pa.ArrowException, OSError) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, gzip.BadGzipFile) and exc.errno:
            raise  # a read error of the disk: its own line (cli)
        codec = {".jsonl.gz": "gzip", ".jsonl.zst": "zstd"}.get(kind, "text")
        raise DataError(
            f"{name}: cannot be read{f' past line {lineno}' if lineno else ''} "
            f"({_one_line(exc) or type(exc).__name__}): the file is cut short or is not {codec}; "
            "copy or compress it again"
        ) from exc


def _jsonl_record(name: str, lineno: int, data: bytes | None) -> Iterator[RawRecord]:
    if data is None:
        error = RecordError("record_too_large", f"line is longer than {MAX_RECORD_BYTES} bytes")
        yield RawRecord(name, lineno, error=error)
        return
    try:
        text = data.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        yield RawRecord(name, lineno, error=RecordError("bad_encoding", _bad_byte(exc)))
        return
    if not text.strip():
        return
    try:
        yield RawRecord(name, lineno, json.loads(text))
    except json.JSONDecodeError as exc:
        yield RawRecord(name, lineno, error=RecordError("bad_json", str(exc)))
    except RecursionError:  # nesting past Python's recursion limit: never a usable record
        error = RecordError("too_deep", "arrays and objects nest too deep for a JSON reader")
        yield RawRecord(name, lineno, error=error)


def _bad_byte(exc: UnicodeDecodeError) -> str:
    return f"byte 0x{exc.object[exc.start]:02x} at byte offset {exc.start} is not valid UTF-8"
