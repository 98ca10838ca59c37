"""Records -> conversations as the chat template sees them, and why a record cannot be used.

A `RawRecord` (read from an input by eyrie.chat.inputs) is named `"<file>:<line>"`;
`to_conversation` turns an OpenAI- or ShareGPT-form record into a `Conversation`: messages with
their reasoning, tool calls and tool results, and the record's tool definitions. A record that
cannot be used raises (or carries) RecordError with a reason from REASONS.
docs/data.md#records-and-messages.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from eyrie.core.errors import EyrieError

# reason -> what the user can do about it
REASONS = {
    "bad_encoding": "re-encode the file as UTF-8",
    "bad_json": "fix the JSON syntax of that record",
    "record_too_large": "split the record (a .jsonl line may hold at most 64 MiB)",
    "too_deep": "flatten the record: eyrie reads records nested at most 64 arrays or objects deep",
    "too_many_turns": "split the conversation: eyrie reads at most 4096 turns a record",
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
        "the target's chat template failed for this conversation (the detail gives the "
        "template's own message), or under data.mask_mode: prefix is not prefix-stable for it"
    ),
    "template_rule": (
        "nothing, or another template: the chat template cannot render this conversation as "
        "the model generates it (the detail names the template's rule)"
    ),
    "no_assistant_tokens_after_truncation": "raise data.max_seq_len or shorten the conversation",
    "regenerate_cut": "raise regenerate.max_new_tokens (the response hit the length limit)",
    "regenerate_failed": "see the regenerate job's log for why generation failed",
}


# Limits a record meets before any of its turns is read, so one hostile record costs itself only:
# nesting (the forms need under 10 levels; tool schemas more) and turns (each turn is rendered
# with the turns before it, so a record's cost grows with the square of its turns).
MAX_DEPTH = 64
MAX_TURNS = 4096


def nested_deeper(value: object, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` nests lists and dicts more than `limit` deep (itself the first level);
    walked without recursion, so any depth is measured."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


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
    line: int  # 1-based line (.jsonl) or 0-based record index (.json, .parquet, datasets)
    obj: object = None
    error: RecordError | None = None

    @property
    def sample_id(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class Conversation:
    """Messages as the template sees them, the record's tool definitions, and what was left out.

    A message has `role` and `content` (a string, or the record's text parts as
    `{"type": "text", "text": ...}`; "" or None for an assistant turn that only calls tools)
    and, when the record gives them, `reasoning_content`, `tool_calls`, `tool_call_id` and `name`.
    `dropped_parts` counts non-text content parts left out (data.non_text: keep_text).
    """

    messages: list[dict]
    tools: list[dict] | None = None
    dropped_parts: int = field(default=0, compare=False)
    # message index -> {"ids": the ids the target generated, end token included, "prompt": the
    # ids_digest of the prompt it generated them after} (regenerated records)
    generated: dict = field(default_factory=dict, compare=False)

    def key(self) -> str:
        """Content hash: two records with the same messages and tools are one conversation."""
        text = json.dumps([self.messages, self.tools], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    def first_turn(self) -> int:
        """The index of the first assistant turn a model generates: one with a message before
        it (an assistant turn that opens the conversation has no prompt: it is context)."""
        return next(i for i, m in enumerate(self.messages) if m["role"] == "assistant" and i > 0)

    def prompt_key(self) -> str:
        """Hash of what precedes the first trained assistant turn (the prompt an evaluation
        decodes)."""
        first = self.first_turn()
        text = json.dumps([self.messages[:first], self.tools], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    def to_record(self) -> dict:
        """The conversation as an OpenAI-form record (`to_conversation` reads it back equal)."""
        record = {"messages": self.messages}
        if self.tools is not None:
            record["tools"] = self.tools
        return record


def content_text(content: object) -> str:
    """A message's content as one text: its text parts joined with "\\n", as vLLM joins them
    for a template that takes text."""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content or ""


def _text_content(content: object, where: str, keep_text: bool) -> tuple[object, int]:
    """A content-part list as its text parts (the template gets them as a server hands them:
    eyrie.chat.template) and the number of other parts (refused unless keep_text); any other
    content as is."""
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
    return [{"type": "text", "text": t} for t in texts], dropped


def _tool_calls(calls: object, where: str) -> list[dict]:
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("function", c), dict) for c in calls
    ):
        raise RecordError("bad_tool_calls", f"{where} must be a list of tool-call objects")
    for k, call in enumerate(calls):
        function = call.get("function", call)
        if not isinstance(function.get("name"), str):
            raise RecordError("bad_tool_calls", f"{where}[{k}] has no function name")
        _check_arguments(function.get("arguments"), f"{where}[{k}]")
    return calls


def _check_arguments(arguments: object, where: str) -> None:
    """Arguments a server takes: an object, or JSON text (parsed before rendering), or none."""
    if isinstance(arguments, str) and arguments.strip():
        try:
            json.loads(arguments)
        except ValueError as exc:
            raise RecordError(
                "bad_tool_calls", f"{where} arguments are not JSON ({exc}): {arguments!r:.60}"
            ) from exc
    elif arguments is not None and not isinstance(arguments, (str, dict)):
        raise RecordError(
            "bad_tool_calls",
            f"{where} arguments are a {type(arguments).__name__}; give an object or JSON text",
        )


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
    if content is not None and not isinstance(content, (str, list)):
        raise RecordError(
            "non_text_content", f"{form}[{i}].{text_key} is a {type(content).__name__}"
        )
    # None stays None (an assistant turn that only calls tools): a server hands it on as no parts
    message = {"role": role, "content": content if content is None else (content or "")}
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
    if not content_text(message["content"]).strip() and not message.get("tool_calls"):
        raise RecordError("empty_content", f"{form}[{i}] ({role}) has no text")
    return message, dropped


def to_conversation(obj: object, non_text: str = "drop") -> Conversation:
    """An OpenAI- or ShareGPT-form record as a Conversation; RecordError if unusable.

    `non_text`: "drop" refuses a record with non-text content parts (non_text_content);
    "keep_text" keeps the record with its text parts and counts the others.
    """
    if not isinstance(obj, dict):
        raise RecordError("unknown_format", f"record is a JSON {type(obj).__name__}, not an object")
    if nested_deeper(obj):
        raise RecordError("too_deep", f"arrays and objects nest more than {MAX_DEPTH} levels deep")
    fm = next((f for f in FORMS if f.name in obj), None)
    if fm is None:
        raise RecordError(
            "unknown_format", f"no 'messages' or 'conversations' key (keys: {sorted(obj)[:8]})"
        )
    form, keys = fm.name, (fm.role_key, fm.text_key)
    turns = obj[form]
    if not isinstance(turns, list) or not turns:
        raise RecordError("unknown_format", f"'{form}' must be a non-empty list")
    if len(turns) > MAX_TURNS:
        raise RecordError(
            "too_many_turns", f"'{form}' holds {len(turns)} turns (at most {MAX_TURNS})"
        )
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
    if not any(m["role"] == "assistant" for m in messages[1:]):
        raise RecordError(
            "no_assistant_turn",
            f"roles are {[m['role'] for m in messages]} (an assistant turn that opens the "
            "conversation answers no prompt)",
        )
    tools = obj.get("tools")
    if isinstance(tools, str):  # datasets often keep the tool definitions as JSON text
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError as exc:
            raise RecordError("bad_tool_calls", f"'tools' is text but not JSON ({exc})") from exc
        except RecursionError:
            raise RecordError("too_deep", "'tools' (JSON text) nests too deep to read") from None
        if nested_deeper(tools):
            raise RecordError("too_deep", f"'tools' nests more than {MAX_DEPTH} levels deep")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise RecordError("bad_tool_calls", "'tools' must be a list of tool-definition objects")
    return Conversation(messages, tools or None, dropped)


def to_messages(obj: object) -> list[dict]:
    """The messages of a record (`to_conversation(obj).messages`)."""
    return to_conversation(obj).messages
