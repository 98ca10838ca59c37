"""The turn rule: for one assistant turn, exactly the prompt an inference server renders for it
and exactly the text the model generates after that prompt, both read off the template's own
renders.

`turn_of` gives both: the prompt is the messages before the turn rendered with the generation
prompt; the generated text is what the render with the turn as the last message writes beyond
that prompt, up to and including the token generation stops on. Where that render does not
extend the prompt, the turn is found in it by its own first character and the header the
generation prompt writes (a template that rewrites the history once a turn follows), or, where
the prompt opens a reasoning block the render leaves out, composed as a reasoning parser splits
a response (reasoning, the block's end, the rest); where the render leaves a final answer's
reasoning out but keeps it for a turn in progress, from that rendering. A turn none of these
derive is dropped with a reason (TURN_DROPS). docs/data.md#the-loss-mask.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from eyrie.chat.encoding import encode, ids_digest
from eyrie.chat.records import Conversation, RecordError, content_text
from eyrie.chat.template import ChatTemplate

SENTINEL = "\u2063"  # invisible separator: marks where a turn's own text ends or begins

# a call the template renders in place of the turn's own, which puts a final answer in progress
PLACEHOLDER_CALL = {
    "id": "functions.eyrie_placeholder:0",
    "type": "function",
    "function": {"name": "eyrie_placeholder", "arguments": {}},
}
PLACEHOLDER_USER = {"role": "user", "content": "Continue."}

REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")

# why a turn is not trained -> the cause and the fix (report.json masks.turns_dropped)
TURN_DROPS = {
    "reasoning_missing": (
        "the prompt opens a reasoning block and the turn has none; switch thinking off in "
        "data.chat_template_kwargs, or set data.regenerate: true"
    ),
    "tool_calls_not_rendered": "the template renders only some of the turn's tool calls",
    "not_derivable": (
        "the template's renders do not show what the model writes after the prompt; set "
        "data.reasoning_parser"
    ),
    "empty_turn": "the template renders no text for the turn",
    "template_error": "the template fails with the turn as the last message",
}


class TurnDropped(Exception):
    """One assistant turn is not trained; `reason` is a key of TURN_DROPS."""

    def __init__(self, reason: str, detail: str):
        assert reason in TURN_DROPS, reason
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}")


@dataclass(frozen=True)
class Turn:
    """One assistant turn: the prompt before it and the text the model generates for it."""

    index: int  # the message index
    prompt: str
    text: str  # ends with the stop token when `stop` is not ""
    reasoning: str  # "" (the turn has none) | "rendered" | "not_rendered"
    path: str  # final | history | closed | in_progress | parser | generated: how it was found
    stop: str  # template | next_role | eos | generated | "": where the stop token came from
    ids: tuple[int, ...] | None = None  # the ids the target generated (regeneration)


INLINE_THINK = re.compile(r"^\s*<think>(.*?)</think>", re.S)


class _Prompt:
    """Turn `i`'s prompt (`text`), and, read once when asked, what its generation prompt adds
    to the render of the messages before it (`header`; None when the prompt does not begin
    with that render) and whether that leaves a reasoning block open or closed."""

    def __init__(self, tpl: ChatTemplate, conv: Conversation, i: int):
        self.tpl, self.conv, self.i = tpl, conv, i
        self.text = tpl.render(conv.messages[:i], add_generation_prompt=True, tools=conv.tools)

    @cached_property
    def header(self) -> str | None:
        history = self.tpl.render(self.conv.messages[: self.i], tools=self.conv.tools)
        return self.text[len(history) :] if self.text.startswith(history) else None

    @cached_property
    def opened(self) -> bool:
        """A start marker after the last end marker: the model writes on inside the block."""
        if self.tpl.markers is None or self.header is None:
            return False
        start, end = self.tpl.markers
        return self.header.rfind(start) > max(self.header.rfind(end), -1)

    @cached_property
    def closed(self) -> bool:
        """A closed block (a thinking switch off, a budget spent): the model writes none."""
        if self.tpl.markers is None or self.header is None:
            return False
        start, end = self.tpl.markers
        return 0 <= self.header.rfind(start) < self.header.rfind(end)


def reasoning_of(message: dict) -> str:
    """An assistant message's reasoning: reasoning_content, else a leading inline <think> block."""
    if message.get("reasoning_content"):
        return message["reasoning_content"].strip()
    inline = INLINE_THINK.match(content_text(message.get("content")))
    return inline.group(1).strip() if inline else ""


def turn_of(tpl: ChatTemplate, conv: Conversation, i: int) -> Turn:
    """Assistant turn `i`'s prompt and generated text; TurnDropped when they cannot be derived,
    RecordError("template_error") when the template fails on the messages before it. A turn the
    target generated after this very prompt (regeneration: `conv.generated`) is its exact ids."""
    messages = conv.messages
    prompt = _Prompt(tpl, conv, i)
    message, reasoning = messages[i], reasoning_of(messages[i])
    exact = conv.generated.get(i)
    if exact is not None and exact["prompt"] == ids_digest(encode(tpl.tokenizer, prompt.text)):
        # what the target generated after this very prompt: its ids are the turn
        text = tpl.tokenizer.decode(exact["ids"], skip_special_tokens=False)
        state = "" if not reasoning else ("rendered" if reasoning in text else "not_rendered")
        return Turn(i, prompt.text, text, state, "generated", "generated", tuple(exact["ids"]))
    if prompt.opened and not reasoning:
        raise TurnDropped(
            "reasoning_missing",
            f"assistant turn {i} has no reasoning, and the generation prompt before it opens "
            f"{tpl.markers[0]!r}",
        )
    found = _generated(tpl, conv, i, prompt, message)
    if found is None and reasoning and not prompt.opened:
        # a prompt that rules reasoning out (a switch off closes an empty block in the
        # generation prompt): the turn as generated after it has none
        found = _generated(tpl, conv, i, prompt, _without(message, *REASONING_KEYS))
    if found is None:
        raise TurnDropped(
            "not_derivable",
            f"assistant turn {i} rendered as the last message does not follow the generation "
            "prompt the template writes before it",
        )
    text, path = found
    if reasoning and reasoning not in text and not (prompt.opened or prompt.closed):
        progress = _in_progress_text(tpl, conv, i, prompt)
        if progress is not None and reasoning in progress:
            text, path = progress, "in_progress"
    _check_calls(tpl, conv, i, prompt, text)
    text, stop = _with_stop(tpl, conv, i, prompt.text, text)
    if not text.strip() or text.strip() in tpl.stops:
        raise TurnDropped("empty_turn", f"assistant turn {i} renders no text")
    state = "" if not reasoning else ("rendered" if reasoning in text else "not_rendered")
    return Turn(i, prompt.text, text, state, path, stop)


def _render_turn(tpl: ChatTemplate, conv: Conversation, i: int, message: dict) -> str:
    try:
        return tpl.render([*conv.messages[:i], message], tools=conv.tools, generated=i)
    except RecordError as err:
        raise TurnDropped("template_error", err.detail) from err


def _generated(
    tpl: ChatTemplate, conv: Conversation, i: int, prompt: _Prompt, message: dict
) -> tuple[str, str] | None:
    """What the model writes for `message` as turn `i` (without its stop-token handling) and
    the path that found it, or None. The render with the turn last extends the prompt: what
    follows it. Else the turn is located in that render: it begins at its first own character
    (the render with a SENTINEL in front of its text differs there), after the header the
    generation prompt writes, searched from the end of the message before it."""
    final = _render_turn(tpl, conv, i, message)
    if final.startswith(prompt.text):
        text = final[len(prompt.text) :]
        # after a prompt that opened a block, only a render that keeps the reasoning in it
        if not prompt.opened or (tpl.markers[1] in text and reasoning_of(message) in text):
            return text, "final"
    header = prompt.header
    if header is None:
        return None
    after = ""
    if prompt.closed:  # what the prompt writes after its closed block
        after = header[header.rfind(tpl.markers[1]) + len(tpl.markers[1]) :]
    if prompt.opened or prompt.closed:  # the role header before the block
        header = header[: header.rfind(tpl.markers[0])]
    own = _first_difference(final, _render_turn(tpl, conv, i, _marked(message, front=True)))
    start = _previous_end(tpl, conv, i, message, final)
    at = final.find(header, start, own) if header else -1
    if at < 0 or at + len(header) > own:
        return None
    rest = final[at + len(header) :]
    if prompt.closed:  # the model writes on after the prompt's closed block (and what follows it)
        answer = _after_block(tpl, rest)
        return (answer[len(after) :] if answer.startswith(after) else answer), "closed"
    if not prompt.opened:
        return rest, "history"
    return reasoning_of(message) + tpl.markers[1] + _after_block(tpl, rest), "parser"


def _after_block(tpl: ChatTemplate, rest: str) -> str:
    """The turn's rendering past any reasoning block (or lone block end) the template writes at
    its start: the answer part."""
    start, end = tpl.markers
    lead = rest.lstrip()
    if lead.startswith(start) or lead.startswith(end):
        at = rest.find(end)
        if at >= 0:
            return rest[at + len(end) :]
        return lead[len(start) :].lstrip()  # an opened block the template never closes
    return rest


def _previous_end(tpl: ChatTemplate, conv: Conversation, i: int, message: dict, final: str) -> int:
    """Where the text of message i-1 ends in `final` (the render with a SENTINEL after it shows
    where), else where `final` leaves the history's render: the turn is searched past it."""
    before = conv.messages[: i - 1]
    try:
        marked = tpl.render(
            [*before, _marked(conv.messages[i - 1], front=False), message],
            tools=conv.tools,
            generated=i,
        )
    except RecordError:
        marked = ""
    at = marked.find(SENTINEL)
    if at >= 0 and marked[:at] == final[:at]:
        return at
    return _first_difference(final, tpl.render(conv.messages[:i], tools=conv.tools))


def _first_difference(a: str, b: str) -> int:
    """The first index where `a` and `b` differ (the shorter one's length if neither does), by
    halving slices: compared in C, a 60 MB record's renders take milliseconds."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[lo:hi] != b[lo:hi]
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[lo:mid] == b[lo:mid] else (lo, mid)
    return lo


def _marked(message: dict, front: bool) -> dict:
    """The message with SENTINEL before (front) or after its content (and, front, reasoning)."""
    marked = dict(message)
    for key in ("content", "reasoning_content") if front else ("content",):
        if key in marked:
            text = content_text(marked[key])
            marked[key] = SENTINEL + text if front else text + SENTINEL
    return marked


def _in_progress_text(tpl: ChatTemplate, conv: Conversation, i: int, prompt: _Prompt) -> str | None:
    """A final answer's text from its in-progress rendering: the turn rendered with a
    placeholder tool call (a turn in progress) up to the end of its content, then what the
    template writes after a final answer's content. None unless the two renderings agree on
    the turn without its reasoning (then only the reasoning differs)."""
    message, before = conv.messages[i], conv.messages[:i]
    if message.get("tool_calls"):
        return None

    def final(m: dict) -> str | None:
        try:
            found = _generated(tpl, Conversation([*before, m], conv.tools), i, prompt, m)
        except TurnDropped:
            return None
        return found[0] if found else None

    def composed(m: dict) -> str | None:
        marked = _marked(m, front=False)
        try:
            head = tpl.render(
                [*before, {**marked, "tool_calls": [PLACEHOLDER_CALL]}],
                tools=conv.tools,
                generated=i,
            )
        except RecordError:
            return None
        head = head[len(prompt.text) :] if head.startswith(prompt.text) else ""
        tail = final(marked) or ""
        if SENTINEL not in head or SENTINEL not in tail:
            return None
        return head[: head.index(SENTINEL)] + tail[tail.index(SENTINEL) + 1 :]

    bare = _without(message, *REASONING_KEYS)
    without = composed(bare)
    if without is None or without != final(bare):
        return None
    return composed(message)


def _check_calls(tpl: ChatTemplate, conv: Conversation, i: int, prompt: _Prompt, text: str) -> None:
    """Every tool call of the turn shows in its text (the text changes when the call is left
    out), or the turn is dropped (tool_calls_not_rendered)."""
    message = conv.messages[i]
    calls = message.get("tool_calls") or []
    shown = 0
    for j in range(len(calls)):
        rest = calls[:j] + calls[j + 1 :]
        fewer = {**message, "tool_calls": rest} if rest else _without(message, "tool_calls")
        try:
            other = _generated(tpl, conv, i, prompt, fewer)
        except TurnDropped:
            other = None  # the template refuses the turn without it: the call counts
        shown += other is None or other[0] != text
    if shown < len(calls):
        raise TurnDropped(
            "tool_calls_not_rendered",
            f"the template renders {shown} of the {len(calls)} tool calls of assistant turn {i}",
        )


def _without(message: dict, *keys: str) -> dict:
    return {k: v for k, v in message.items() if k not in keys}


def _with_stop(
    tpl: ChatTemplate, conv: Conversation, i: int, prompt: str, text: str
) -> tuple[str, str]:
    """The turn's text up to and including the token generation stops on, and where that token
    came from: the first stop token of the text (what the template writes after it is not
    generated); else the first stop token the template writes after the turn when a message
    follows it (GLM ends a turn with the next role's <|user|> or <|observation|>); else the
    tokenizer's eos (generation ends only on a stop token)."""
    found = [(text.find(s), s) for s in tpl.stops if s and s in text]
    if found:
        at, stop = min(found)
        return text[: at + len(stop)], "template"
    generated = text.rstrip()
    messages = conv.messages
    following = messages[i + 1] if i + 1 < len(messages) else None
    if following is None or following["role"] not in ("user", "tool"):
        following = _placeholder_after(messages[i])
    try:
        after = tpl.render(
            [*messages[:i], _marked(messages[i], front=False), following],
            tools=conv.tools,
            generated=i,
        )
    except RecordError:
        after = ""
    start = after.find(SENTINEL, len(prompt) if after.startswith(prompt) else 0)
    found = [(after.find(s, start), s) for s in tpl.stops if s and start >= 0]
    found = [(at, s) for at, s in found if at >= 0]
    if found:
        return generated + min(found)[1], "next_role"
    eos = getattr(tpl.tokenizer, "eos_token", None)
    return (generated + eos, "eos") if eos else (generated, "")


def _placeholder_after(message: dict) -> dict:
    """What follows a turn that ends the conversation: a tool result after calls, else a user."""
    calls = message.get("tool_calls")
    if calls:
        return {"role": "tool", "tool_call_id": calls[0].get("id", ""), "content": "ok"}
    return PLACEHOLDER_USER
