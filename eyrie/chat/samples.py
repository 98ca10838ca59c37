"""What is trained: for every assistant turn, exactly the text the model generates for it, after
exactly the prompt an inference server renders for it (each turn found by
eyrie.chat.turn.turn_of).

`masked_samples` joins turns whose contexts continue one another, token for token, into samples
and encodes them with their loss mask; `template_traits` tests a template once.
docs/data.md#the-loss-mask.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from eyrie.chat.encoding import Piece, encode_many, encode_pieces, same_ids
from eyrie.chat.records import Conversation, RecordError
from eyrie.chat.template import ChatTemplate
from eyrie.chat.turn import TURN_DROPS, Turn, TurnDropped, reasoning_of, turn_of
from eyrie.core.errors import DataError

GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class Sample:
    """One training sample: its text in pieces, each trained (a turn the model generates) or
    not (context)."""

    pieces: list[Piece]
    turns: list[int]  # the message index of each assistant turn trained in this sample

    @property
    def text(self) -> str:
        return "".join(piece.text for piece in self.pieces)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """The [start, end) character spans of the trained pieces."""
        out, at = [], 0
        for text, trained, _ in self.pieces:
            if trained:
                out.append((at, at + len(text)))
            at += len(text)
        return out


@dataclass(frozen=True)
class MaskSettings:
    mode: str = "auto"
    train_reasoning: bool = True


@dataclass
class Masked:
    """A conversation's samples as token ids and loss masks, and how they were made."""

    samples: list[tuple[list[int], list[int]]]
    mode: str  # the mode that made them: prefix | per_turn | generation
    counts: dict = field(default_factory=dict)  # TURN_COUNTS, and `dropped`: {reason: turns}


# per record, summed in report.json's masks.turns
TURN_COUNTS = (
    "trained",
    "reasoning_rendered",
    "reasoning_in_progress",
    "reasoning_parsed",
    "generated_ids",
    "reasoning_not_rendered",
    "stop_from_next_role",
    "stop_appended",
    "without_stop_token",
    "context_tokens",
    "overhead_tokens",
)


# ----------------------------------------------------------------------------- samples


def turn_samples(tpl: ChatTemplate, turns: list[Turn], max_tokens: int | None = None) -> tuple:
    """Each turn after its prompt; a turn joins the previous sample when that sample's tokens
    and the text between, encoded, are token for token the turn's prompt as a server encodes
    it, so a prefix-stable stretch costs one sample. Returns the samples and their (ids, mask),
    cut past `max_tokens` as encode_pieces cuts them."""
    texts = []  # per turn: its prompt, its text, the text between the turn before and it
    for k, turn in enumerate(turns):
        before = turns[k - 1].prompt + turns[k - 1].text if k else None
        between = turn.prompt[len(before) :] if k and turn.prompt.startswith(before) else ""
        texts += [turn.prompt, turn.text if turn.ids is None else "", between]
    ids = encode_many(tpl.tokenizer, texts, max_tokens)
    samples: list[Sample] = []
    encoded: list[tuple[list[int], list[int]]] = []
    for k, turn in enumerate(turns):
        prompt, text, between = ids[3 * k : 3 * k + 3]
        text = list(turn.ids) if turn.ids is not None else text
        last = samples[-1] if samples else None
        if last is not None and turn.prompt.startswith(last.text):
            joined = encoded[-1][0] + between
            if same_ids(prompt, joined, max_tokens):
                gap = Piece(turn.prompt[len(last.text) :], False)
                pieces = [*last.pieces, gap, Piece(turn.text, True, turn.ids)]
                samples[-1] = Sample(pieces, [*last.turns, turn.index])
                mask = encoded[-1][1] + [0] * len(between) + [1] * len(text)
                encoded[-1] = (joined + text, mask)
                continue
        pieces = [Piece(turn.prompt, False), Piece(turn.text, True, turn.ids)]
        samples.append(Sample(pieces, [turn.index]))
        encoded.append((prompt + text, [0] * len(prompt) + [1] * len(text)))
    if max_tokens is not None:  # what lies past max_tokens is cut: one id past it is kept
        encoded = [(i[: max_tokens + 1], m[: max_tokens + 1]) for i, m in encoded]
    return samples, encoded


def _counts(turns: list[Turn], drops: dict, samples: list, encoded: list) -> dict:
    contexts = [
        sum(1 for bit in mask[: mask.index(1)] if not bit) if 1 in mask else len(mask)
        for _, mask in encoded
    ]
    return {
        "trained": len(turns),
        "reasoning_rendered": sum(t.reasoning == "rendered" for t in turns),
        "reasoning_in_progress": sum(t.path == "in_progress" for t in turns),
        "reasoning_parsed": sum(t.path == "parser" for t in turns),
        "generated_ids": sum(t.ids is not None for t in turns),
        "reasoning_not_rendered": sum(t.reasoning == "not_rendered" for t in turns),
        "stop_from_next_role": sum(t.stop == "next_role" for t in turns),
        "stop_appended": sum(t.stop == "eos" for t in turns),
        "without_stop_token": sum(not t.stop for t in turns),
        "context_tokens": sum(contexts),
        "overhead_tokens": sum(contexts[1:]),
        "dropped": drops,
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
    text, pieces, at = texts[0], [], 0
    for a, b in sorted((a, b) for a, b in indices[0] if b > a):
        pieces += [Piece(text[at:a], False), Piece(text[a:b], True)]
        at = b
    return Sample([*pieces, Piece(text[at:], False)], turns)


def _reasoning_excluded(tokenizer, sample: Sample, conv: Conversation) -> Sample:
    """The sample with each trained turn's reasoning (and what precedes it in its piece) out of
    the loss (a turn's exact ids split after the first token whose text completes it)."""
    pieces, turns = [], iter(sample.turns)
    for piece in sample.pieces:
        reasoning = reasoning_of(conv.messages[next(turns)]) if piece.trained else ""
        at = piece.text.find(reasoning) if reasoning else -1
        if at < 0:
            pieces.append(piece)
            continue
        cut = at + len(reasoning)
        if piece.ids is None:
            pieces += [Piece(piece.text[:cut], False), Piece(piece.text[cut:], True)]
            continue
        k = next(
            k
            for k in range(1, len(piece.ids) + 1)
            if reasoning in tokenizer.decode(piece.ids[:k], skip_special_tokens=False)
        )
        head = tokenizer.decode(piece.ids[:k], skip_special_tokens=False)
        pieces += [
            Piece(head, False, piece.ids[:k]),
            Piece(piece.text[len(head) :], True, piece.ids[k:]),
        ]
    return Sample(pieces, sample.turns)


def as_template(template) -> ChatTemplate:
    """A ChatTemplate, or one made of a bare tokenizer (no switches, its own eos)."""
    return template if isinstance(template, ChatTemplate) else ChatTemplate.of(template)


def conversation_turns(tpl: ChatTemplate, conv: Conversation) -> tuple[list[Turn], dict]:
    """The conversation's trained turns and the dropped ones by reason; RecordError when none
    is trained (template_error where the template fails, else template_rule naming the first
    drop's reason)."""
    first = conv.first_turn()  # a turn with no message before it has no prompt: context only
    indices = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant" and i >= first]
    turns, drops, first_drop = [], {}, None
    for i in indices:
        try:
            turns.append(turn_of(tpl, conv, i))
        except TurnDropped as drop:
            drops[drop.reason] = drops.get(drop.reason, 0) + 1
            first_drop = first_drop or drop
    if not turns:
        if first_drop.reason == "template_error":
            raise RecordError("template_error", first_drop.detail)
        reason = first_drop.reason
        raise RecordError("template_rule", f"{reason}: {TURN_DROPS[reason]} ({first_drop.detail})")
    return turns, drops


def conversation_samples(
    tpl: ChatTemplate, conv: Conversation, mode: str, max_tokens: int | None = None
) -> tuple:
    """(samples, their encodings, the mode that made them, turn counts) of one conversation
    under `mode`."""
    if mode == "generation":
        sample = generation_sample(tpl, conv)
        return [sample], [encode_pieces(tpl.tokenizer, sample.pieces, max_tokens)], mode, {}
    turns, drops = conversation_turns(tpl, conv)
    samples, encoded = turn_samples(tpl, turns, max_tokens)
    if mode == "prefix" and len(samples) > 1:
        k = samples[1].turns[0]
        raise RecordError(
            "template_error",
            f"not prefix-stable: the prompt of assistant turn {k} does not continue the text "
            "before it token for token (the template re-renders the history)",
        )
    made = mode if mode == "per_turn" else ("prefix" if len(samples) == 1 else "per_turn")
    return samples, encoded, made, _counts(turns, drops, samples, encoded)


def masked_samples(
    template, conv: Conversation, settings: MaskSettings, max_tokens: int | None = None
) -> Masked:
    """The training samples of one conversation under `settings.mode`, encoded with their loss
    masks; RecordError if no turn can be trained (or, mode prefix, the template is not
    prefix-stable for it). With `max_tokens`, a sample's tokens past it may be left out."""
    tpl = as_template(template)
    samples, encoded, mode, counts = conversation_samples(tpl, conv, settings.mode, max_tokens)
    if not settings.train_reasoning:
        samples = [_reasoning_excluded(tpl.tokenizer, s, conv) for s in samples]
        encoded = [encode_pieces(tpl.tokenizer, s.pieces, max_tokens) for s in samples]
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
    content: str = "string"  # how content reaches the template: string | openai (parts)
    reasoning: str = "field"  # how reasoning reaches it: field | chunks | none
    markers: tuple[str, str] | None = None  # the reasoning block's start and end
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
            "content_format": self.content,
            "reasoning_form": self.reasoning,
            "reasoning_markers": list(self.markers) if self.markers else None,
        }


def template_traits(template) -> TemplateTraits:
    """Test the template once on PROBE (without its system turn if the template refuses one,
    then PLAIN); `renders` is False only when even PLAIN fails to render (detail: the
    template's own message): what one conversation's turns show never refuses the target."""
    tpl = as_template(template)
    marks = bool(GENERATION_MARK.search(tpl.tokenizer.get_chat_template()))
    forms = (tpl.tool_arguments, tpl.stops, tpl.content, tpl.reasoning, tpl.markers)
    for probe in (PROBE, Conversation(PROBE.messages[1:]), PLAIN):
        try:
            turns, _ = conversation_turns(tpl, probe)
        except RecordError:
            continue
        samples, _ = turn_samples(tpl, turns)
        last = turns[-1]
        stable = len(samples) == 1 and len(turns) == len(probe.messages) // 2
        mode = "prefix" if stable else "per_turn"
        detail = "" if stable else "the probe's turns need a sample each"
        rendered = last.reasoning == "rendered"
        return TemplateTraits(
            stable, marks, rendered, last.path == "in_progress", mode, *forms, True, detail
        )
    try:
        tpl.render(PLAIN.messages)
        tpl.render(PLAIN.messages[:1], add_generation_prompt=True)
    except RecordError as err:
        detail = f"the template fails on a plain exchange: {err.detail}"
        return TemplateTraits(False, marks, False, False, "per_turn", *forms, False, detail)
    detail = "no turn of the probe conversations can be trained (see the records' reasons)"
    return TemplateTraits(False, marks, False, False, "per_turn", *forms, True, detail)


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
