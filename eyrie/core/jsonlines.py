"""The one reader of a JSON-lines file eyrie writes or is given by name (question.jsonl, the
demo's conversations, the regenerate stage's shards): one JSON value a line, blank lines skipped,
a line that is not JSON one error naming the file and the line. Conversation inputs, which may
be compressed and keep a bad line as a dropped record, are read by eyrie.chat.inputs instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator


def read_json_lines(
    path: str | Path, bad_line: Callable[[str, json.JSONDecodeError], Exception]
) -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-blank line of `path`, read as UTF-8 text (a line ends at
    LF, CRLF or CR); a line that is not JSON raises `bad_line("<path>:<line>", its error)`."""
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise bad_line(f"{path}:{lineno}", exc) from None
            yield lineno, value
