"""One assistant turn as trained: exactly the text the model generates for it, after exactly the
prompt an inference server renders for it.

`turn_of` finds both: the prompt is the messages before the turn rendered with the generation
prompt; the generated text is the turn as the template renders it last, or, where that rendering
leaves out the turn's reasoning while the template keeps reasoning for a turn still in progress
(Kimi-K2-Thinking renders everything up to the last answer as history), the turn as it is
rendered in progress; it ends with the token generation stops on (where the template writes
none, the stop token it writes after the turn). docs/data.md#the-loss-mask.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from eyrie.chat.records import Conversation, RecordError
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


@dataclass(frozen=True)
class Turn:
    """One assistant turn: the prompt before it, the text the model generates for it (with the
    template's whitespace after it) and how that text was found."""

    index: int  # the message index
    prompt: str
    text: str
    end: int  # the characters of `text` the model generates (the template's whitespace after)
    reasoning: str  # "" (the turn has none) | "rendered" | "not_rendered"
    in_progress: bool  # the text is the turn's in-progress rendering
    stop: bool  # the text ends with a stop token


INLINE_THINK = re.compile(r"^\s*<think>(.*?)</think>", re.S)


def reasoning_of(message: dict) -> str:
    """An assistant message's reasoning: reasoning_content, else a leading inline <think> block."""
    if message.get("reasoning_content"):
        return message["reasoning_content"].strip()
    inline = INLINE_THINK.match(message.get("content") or "")
    return inline.group(1).strip() if inline else ""


def turn_of(tpl: ChatTemplate, conv: Conversation, i: int) -> Turn:
    """Assistant turn `i`'s prompt and generated text; RecordError when the template cannot
    render it as generated (template_error, template_rule)."""
    messages, tools = conv.messages, conv.tools
    prompt = tpl.render(messages[:i], add_generation_prompt=True, tools=tools)
    try:
        text = _final_text(tpl, conv, i, prompt)
    except RecordError:
        if not reasoning_of(messages[i]):
            raise
        # a prompt that rules reasoning out (a thinking switch off closes an empty block in the
        # generation prompt): the turn as generated after it has none
        bare = Conversation([*messages[:i], _without(messages[i], *REASONING_KEYS)], tools)
        text = _final_text(tpl, bare, i, prompt)
    if not text.strip():
        raise RecordError(
            "template_error",
            f"assistant turn {i} renders no text: the template must write each assistant "
            "turn's text, or no token of it can carry loss (docs/data.md#the-loss-mask)",
        )
    reasoning, in_progress = reasoning_of(messages[i]), False
    if reasoning and reasoning not in text:
        progress = _in_progress_text(tpl, conv, i, prompt)
        if progress is not None and reasoning in progress:
            text, in_progress = progress, True
    _check_calls(tpl, conv, i, prompt, text)
    text, end, stop = _with_stop(tpl, conv, i, prompt, text)
    state = "" if not reasoning else ("rendered" if reasoning in text else "not_rendered")
    return Turn(i, prompt, text, end, state, in_progress, stop)


def _final_text(tpl: ChatTemplate, conv: Conversation, i: int, prompt: str) -> str:
    """Turn `i` as the template renders it as the last message: what follows the prompt, or,
    where the turn also changes the history (gpt-oss drops a call's analysis once an answer
    exists, Kimi-K2-Thinking an earlier call's reasoning), what follows the generation prompt
    in front of the turn's first own character."""
    messages, tools = conv.messages, conv.tools
    upto = tpl.render(messages[: i + 1], tools=tools)
    if upto.startswith(prompt):
        return upto[len(prompt) :]
    history = tpl.render(messages[:i], tools=tools)
    other = tpl.render([*messages[:i], _marked(messages[i], front=True)], tools=tools)
    differ = next((k for k, (a, b) in enumerate(zip(upto, other)) if a != b), len(upto))
    generation = prompt[len(history) :] if prompt.startswith(history) else ""
    at = upto.rfind(generation, 0, differ) if generation else -1
    if at < 0:
        raise RecordError(
            "template_error",
            f"assistant turn {i} rendered as the final turn does not follow the generation "
            "prompt the template writes before it",
        )
    return upto[at + len(generation) :]


def _marked(message: dict, front: bool) -> dict:
    """The message with SENTINEL before (front) or after its content and reasoning."""
    marked = dict(message)
    for key in ("content", "reasoning_content") if front else ("content",):
        if key in marked:
            marked[key] = SENTINEL + marked[key] if front else marked[key] + SENTINEL
    return marked


def _in_progress_text(tpl: ChatTemplate, conv: Conversation, i: int, prompt: str) -> str | None:
    """A final answer's text from its in-progress rendering: the turn rendered with a
    placeholder tool call (a turn in progress) up to the end of its content, then what the
    template writes after a final answer's content. None unless the two renderings agree on
    the turn without its reasoning (then only the reasoning differs)."""
    message, before = conv.messages[i], conv.messages[:i]
    if message.get("tool_calls"):
        return None

    def final(m: dict) -> str | None:
        try:
            return _final_text(tpl, Conversation([*before, m], conv.tools), i, prompt)
        except RecordError:
            return None

    def composed(m: dict) -> str | None:
        marked = _marked(m, front=False)
        try:
            head = tpl.render(
                [*before, {**marked, "tool_calls": [PLACEHOLDER_CALL]}], tools=conv.tools
            )
        except RecordError:
            return None
        head = head[len(prompt) :] if head.startswith(prompt) else ""
        tail = final(marked) or ""
        if SENTINEL not in head or SENTINEL not in tail:
            return None
        return head[: head.index(SENTINEL)] + tail[tail.index(SENTINEL) + 1 :]

    bare = _without(message, *REASONING_KEYS)
    without = composed(bare)
    if without is None or without != final(bare):
        return None
    return composed(message)


def _check_calls(tpl: ChatTemplate, conv: Conversation, i: int, prompt: str, text: str) -> None:
    """Every tool call of the turn shows in its text (the text changes when the call is left
    out), or the record is dropped (template_rule)."""
    message = conv.messages[i]
    calls = message.get("tool_calls") or []
    shown = 0
    for j in range(len(calls)):
        rest = calls[:j] + calls[j + 1 :]
        fewer = {**message, "tool_calls": rest} if rest else _without(message, "tool_calls")
        try:
            other = _final_text(
                tpl, Conversation([*conv.messages[:i], fewer], conv.tools), i, prompt
            )
        except RecordError:
            other = None  # the template refuses the turn without it: the call counts
        shown += other != text
    if shown < len(calls):
        raise RecordError(
            "template_rule",
            f"tool_calls_not_rendered: the template renders {shown} of the {len(calls)} tool "
            f"calls of assistant turn {i} (it leaves out parallel calls)",
        )


def _without(message: dict, *keys: str) -> dict:
    return {k: v for k, v in message.items() if k not in keys}


def _with_stop(tpl: ChatTemplate, conv: Conversation, i: int, prompt: str, text: str):
    """The turn's text ending with its stop token, the generated length, and whether a stop
    token was found: the template's own end of turn, else the first stop token the template
    writes after the turn's own text when a message follows it (GLM ends a turn with the next
    role's <|user|> or <|observation|>)."""
    generated = text.rstrip()
    if any(generated.endswith(s) for s in tpl.stops):
        return text, len(generated), True
    messages = conv.messages
    following = messages[i + 1] if i + 1 < len(messages) else None
    if following is None or following["role"] not in ("user", "tool"):
        following = _placeholder_after(messages[i])
    try:
        after = tpl.render(
            [*messages[:i], _marked(messages[i], front=False), following], tools=conv.tools
        )
    except RecordError:
        return text, len(generated), False
    start = after.find(SENTINEL, len(prompt) if after.startswith(prompt) else 0)
    found = sorted((after.find(s, start), s) for s in tpl.stops if s)
    found = [(at, s) for at, s in found if at >= 0]
    if start < 0 or not found:
        return text, len(generated), False
    stop = found[0][1]
    return generated + stop, len(generated) + len(stop), True


def _placeholder_after(message: dict) -> dict:
    """What follows a turn that ends the conversation: a tool result after calls, else a user."""
    calls = message.get("tool_calls")
    if calls:
        return {"role": "tool", "tool_call_id": calls[0].get("id", ""), "content": "ok"}
    return PLACEHOLDER_USER
