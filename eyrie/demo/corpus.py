"""The demo's conversations file read back.

Both demo stages use it (`eyrie demo-conversations` checks what it wrote, `eyrie demo-target`
trains on it); the file is OpenAI-form JSONL, one `{"messages": [...]}` per line (docs/data.md).
Their settings are eyrie.config.stages' DemoConversationsSettings and DemoTargetSettings.
"""

from __future__ import annotations

import json
from pathlib import Path

from eyrie.core.errors import ConversationsError
from eyrie.core.jsonlines import read_json_lines

ROLES = ("system", "user", "assistant")


def check_messages(messages, where: str) -> None:
    """Raise ConversationsError naming `where` unless `messages` is a well-formed chat."""
    if not isinstance(messages, list) or not messages:
        raise ConversationsError(
            f"{where}: 'messages' must be a non-empty list of {{role, content}} objects"
        )
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ConversationsError(f"{where}: messages[{j}] needs a role in {list(ROLES)}")
        if not isinstance(m.get("content"), str) or not m["content"]:
            raise ConversationsError(f"{where}: messages[{j}].content must be a non-empty string")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConversationsError(f"{where}: no assistant turn; every conversation needs one")


def read_conversations(path: str | Path) -> list[list[dict]]:
    """Read an OpenAI-form JSONL file; each bad line raises one error naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConversationsError(f"{path}: not found; run `eyrie demo-conversations` first")
    out = []
    for lineno, record in read_json_lines(path, _not_json):
        where = f"{path}:{lineno}"
        if not isinstance(record, dict) or "messages" not in record:
            raise ConversationsError(f"{where}: expected an object with key 'messages'")
        check_messages(record["messages"], where)
        out.append(record["messages"])
    if not out:
        raise ConversationsError(
            f"{path}: no conversations; regenerate it with `eyrie demo-conversations`"
        )
    return out


def _not_json(where: str, exc: json.JSONDecodeError) -> ConversationsError:
    return ConversationsError(
        f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); fix or remove the line"
    )
