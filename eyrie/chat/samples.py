"""What is trained: for every assistant turn, exactly the text the model generates for it, after
exactly the prompt an inference server renders for it (each turn found by
eyrie.chat.turn.turn_of).

`masked_samples` joins turns whose contexts continue one another into samples and encodes them
with their loss mask; `template_traits` tests a template once. docs/data.md#the-loss-mask.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from eyrie.chat.encoding import encode_head
from eyrie.chat.records import Conversation, RecordError
from eyrie.chat.template import ChatTemplate
from eyrie.chat.turn import Turn, reasoning_of, turn_of
from eyrie.core.errors import DataError

GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")


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
    With `max_tokens`, a sample's tokens past it may be left out (eyrie.chat.encoding)."""
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
