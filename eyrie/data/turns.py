"""What is trained: for every assistant turn, exactly the text the model generates for it, after
exactly the prompt an inference server renders for it.

`turn_of` finds both for one turn: the prompt is the messages before it rendered with the
generation prompt; the generated text is the turn as the template renders it last, or, where that
rendering leaves out the turn's reasoning while the template keeps reasoning for a turn still in
progress (Kimi-K2-Thinking renders everything up to the last answer as history), the turn as it
is rendered in progress; it ends with the token generation stops on (where the template writes
none, the stop token it writes after the turn). `masked_samples` joins turns whose contexts
continue one another into samples and encodes them with their loss mask; `template_traits`
tests a template once. docs/data.md#the-loss-mask.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from eyrie.core.errors import DataError
from eyrie.data.chat import ChatTemplate
from eyrie.data.encoding import encode_head
from eyrie.data.records import Conversation, RecordError

GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")

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


@dataclass
class Sample:
    """One training sample: the text and the [start, end) character spans with loss."""

    text: str
    spans: list[tuple[int, int]]
    turns: list[int]  # the message index of each assistant turn trained in this sample


@dataclass(frozen=True)
class MaskSettings:
    mode: str = "auto"
    train_reasoning: bool = True


@dataclass
class Masked:
    """A conversation's samples as token ids and loss masks, and how they were made."""

    samples: list[tuple[list[int], list[int]]]
    mode: str  # the mode that made them: prefix | per_turn | generation
    counts: dict = field(default_factory=dict)  # TURN_COUNTS


# per record, summed in report.json's masks.turns
TURN_COUNTS = (
    "trained",
    "reasoning_rendered",
    "reasoning_in_progress",
    "reasoning_not_rendered",
    "without_stop_token",
)


INLINE_THINK = re.compile(r"^\s*<think>(.*?)</think>", re.S)


def reasoning_of(message: dict) -> str:
    """An assistant message's reasoning: reasoning_content, else a leading inline <think> block."""
    if message.get("reasoning_content"):
        return message["reasoning_content"].strip()
    inline = INLINE_THINK.match(message.get("content") or "")
    return inline.group(1).strip() if inline else ""


# ----------------------------------------------------------------------------- one turn


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


# ----------------------------------------------------------------------------- samples


def turn_samples(turns: list[Turn]) -> list[Sample]:
    """Each turn after its prompt; a turn joins the previous sample when that sample's text up
    to its last span is exactly what precedes it, so a prefix-stable stretch costs one sample."""
    samples: list[Sample] = []
    for turn in turns:
        text = turn.prompt + turn.text
        span = (len(turn.prompt), len(turn.prompt) + turn.end)
        last = samples[-1] if samples else None
        if last is not None and text.startswith(last.text[: last.spans[-1][1]]):
            samples[-1] = Sample(text, [*last.spans, span], [*last.turns, turn.index])
        else:
            samples.append(Sample(text, [span], [turn.index]))
    return samples


def _counts(turns: list[Turn]) -> dict:
    return {
        "trained": len(turns),
        "reasoning_rendered": sum(t.reasoning == "rendered" for t in turns),
        "reasoning_in_progress": sum(t.in_progress for t in turns),
        "reasoning_not_rendered": sum(t.reasoning == "not_rendered" for t in turns),
        "without_stop_token": sum(not t.stop for t in turns),
    }


def generation_sample(tpl: ChatTemplate, conv: Conversation) -> Sample:
    """The whole rendering with the spans the template marks with `{% generation %}`."""
    from transformers.utils.chat_template_utils import render_jinja_template

    tok = tpl.tokenizer
    try:
        texts, indices = render_jinja_template(
            conversations=[tpl.view(conv.messages)],
            tools=conv.tools,
            chat_template=tok.get_chat_template(tools=conv.tools),
            return_assistant_tokens_mask=True,
            **{**tok.special_tokens_map, **tpl.kwargs},
        )
    except Exception as exc:  # noqa: BLE001 - template errors have many types
        raise RecordError(
            "template_error", f"rendering failed: {type(exc).__name__}: {exc}"
        ) from exc
    turns = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
    spans = sorted((a, b) for a, b in indices[0] if b > a)
    return Sample(texts[0], spans, turns)


def _reasoning_excluded(sample: Sample, conv: Conversation) -> Sample:
    """The sample with each trained turn's reasoning (and what precedes it in its span) out of
    the loss."""
    spans, k = list(sample.spans), 0
    for turn in sample.turns:
        reasoning = reasoning_of(conv.messages[turn])
        if not reasoning:
            continue
        for j in range(k, len(spans)):
            a, b = spans[j]
            at = sample.text.find(reasoning, a, b)
            if at >= 0:
                spans[j], k = (at + len(reasoning), b), j
                break
    return Sample(sample.text, spans, sample.turns)


def as_template(template) -> ChatTemplate:
    """A ChatTemplate, or one made of a bare tokenizer (no switches, its own eos)."""
    return template if isinstance(template, ChatTemplate) else ChatTemplate.of(template)


def conversation_samples(tpl: ChatTemplate, conv: Conversation, mode: str) -> tuple:
    """(samples, the mode that made them, turn counts) of one conversation under `mode`."""
    if mode == "generation":
        return [generation_sample(tpl, conv)], "generation", {}
    first = conv.first_turn()  # a turn with no message before it has no prompt: context only
    indices = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant" and i >= first]
    turns = [turn_of(tpl, conv, i) for i in indices]
    samples = turn_samples(turns)
    if mode == "prefix" and len(samples) > 1:
        k = samples[1].turns[0]
        raise RecordError(
            "template_error",
            f"not prefix-stable: the prompt of assistant turn {k} does not continue the text "
            "before it (the template re-renders the history)",
        )
    made = mode if mode == "per_turn" else ("prefix" if len(samples) == 1 else "per_turn")
    return samples, made, _counts(turns)


def masked_samples(
    template, conv: Conversation, settings: MaskSettings, max_tokens: int | None = None
) -> Masked:
    """The training samples of one conversation under `settings.mode`, encoded with their loss
    masks; RecordError if the template fails (or, mode prefix, is not prefix-stable for it).
    With `max_tokens`, a sample's tokens past it may be left out (eyrie.data.encoding)."""
    tpl = as_template(template)
    samples, mode, counts = conversation_samples(tpl, conv, settings.mode)
    if not settings.train_reasoning:
        samples = [_reasoning_excluded(s, conv) for s in samples]
    encoded = [encode_head(tpl.tokenizer, s.text, s.spans, max_tokens) for s in samples]
    return Masked(encoded, mode, counts)


def render_with_mask(template, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the conversation and its loss mask (same length), as one sample;
    RecordError("template_error") when the template is not prefix-stable for it."""
    masked = masked_samples(template, Conversation(messages), MaskSettings("prefix"))
    return masked.samples[0]


def prompt_ids(template, conv: Conversation | list[dict]) -> list[int]:
    """The messages before the first trained assistant turn, rendered with the generation
    prompt."""
    tpl = as_template(template)
    if not isinstance(conv, Conversation):
        conv = Conversation(conv)
    first = conv.first_turn()
    text = tpl.render(conv.messages[:first], add_generation_prompt=True, tools=conv.tools)
    return list(tpl.tokenizer.encode(text, add_special_tokens=False))


# ----------------------------------------------------------------------------- the template, once

PROBE = Conversation(
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven.", "reasoning_content": "Seven is prime."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Eleven.", "reasoning_content": "Eleven is prime."},
    ]
)
PLAIN = Conversation(
    [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
)


@dataclass(frozen=True)
class TemplateTraits:
    """What a template does with a multi-turn conversation with reasoning."""

    prefix_stable: bool  # the probe's turns make one sample
    generation_marks: bool  # the template marks assistant text with {% generation %}
    renders_reasoning: bool  # the final turn's reasoning reaches the trained text
    reasoning_in_progress: bool  # ... through the turn's in-progress rendering
    auto_mode: str  # what data.mask_mode: auto does with conversations like the probe
    tool_arguments: str  # how tool-call arguments reach the template: object | string
    stop_tokens: tuple[str, ...]
    renders: bool = True  # False: not even a plain user/assistant exchange renders
    detail: str = ""

    def as_dict(self) -> dict:
        return {
            "prefix_stable": self.prefix_stable,
            "generation_marks": self.generation_marks,
            "renders_reasoning": self.renders_reasoning,
            "reasoning_in_progress": self.reasoning_in_progress,
            "auto_mode": self.auto_mode,
            "tool_arguments": self.tool_arguments,
            "stop_tokens": list(self.stop_tokens),
        }


def template_traits(template) -> TemplateTraits:
    """Test the template once on PROBE (without its system turn if the template refuses one);
    `renders` is False when even PLAIN fails (detail: the template's own message)."""
    tpl = as_template(template)
    marks = bool(GENERATION_MARK.search(tpl.tokenizer.get_chat_template()))
    error = None
    for probe in (PROBE, Conversation(PROBE.messages[1:]), PLAIN):
        try:
            samples, mode, _ = conversation_samples(tpl, probe, "auto")
        except RecordError as err:
            error = err
            continue
        last = turn_of(tpl, probe, len(probe.messages) - 1)
        detail = "" if mode == "prefix" else "the probe's turns need a sample each"
        return TemplateTraits(
            mode == "prefix",
            marks,
            last.reasoning == "rendered",
            last.in_progress,
            mode,
            tpl.tool_arguments,
            tpl.stops,
            True,
            detail,
        )
    detail = f"the template fails on a plain exchange: {error.detail}"
    return TemplateTraits(
        False, marks, False, False, "per_turn", tpl.tool_arguments, tpl.stops, False, detail
    )


def check_mode(traits: TemplateTraits, mode: str, where: str) -> None:
    """DataError when the template cannot render any record, or `mode` cannot work with it at
    all (one line, with the fix)."""
    if not traits.renders:
        raise DataError(
            f"{where}: the chat template cannot render a conversation ({traits.detail}); fix "
            "the template (chat_template.jinja or tokenizer_config.json) or "
            "data.chat_template_kwargs"
        )
    if mode == "generation" and not traits.generation_marks:
        raise DataError(
            f"{where}: data.mask_mode: generation, but the chat template has no "
            "{% generation %} markers; use data.mask_mode: auto"
        )
    if mode == "prefix" and not traits.prefix_stable:
        raise DataError(
            f"{where}: data.mask_mode: prefix, but the chat template is not prefix-stable "
            f"({traits.detail}); use data.mask_mode: auto (or per_turn)"
        )
