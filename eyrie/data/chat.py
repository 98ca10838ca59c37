"""The target's chat template as token ids and an assistant-only loss mask.

`load_chat_tokenizer` loads the target's tokenizer (refusing a folder without tokenizer files,
`tokenizer_files_problem`, and a tokenizer without a chat template);
`render` is the template's text for a conversation (its tools and template switches passed);
`masked_samples` turns one conversation into training samples under a mask mode: `prefix` (one
sample, spans found by rendering prefixes: a prefix-stable template), `per_turn` (each assistant
turn trained in the context the model sees when it generates it), `generation` (the template's
own `{% generation %}` markers), `auto` (prefix where the conversation is prefix-stable, else
per_turn). `template_traits` tests a template once. docs/data.md#the-loss-mask.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from eyrie.data.records import Conversation, RecordError, _one_line
from eyrie.errors import DataError

GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")

# The files transformers builds a tokenizer from (its tokenizers' vocab_files_names): a fast
# tokenizer.json, a sentencepiece *.model (tokenizer.model, spiece.model, ...), BPE or WordPiece
# vocabularies, tiktoken ranks. A folder with none of them fails in transformers with several
# lines about sentencepiece, or loads as an empty tokenizer of 3 tokens.
TOKENIZER_FILES = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "*.tiktoken")


def tokenizer_files_problem(folder: str | Path, trust_remote_code: bool = False) -> str | None:
    """One line naming `folder`, the files looked for and the fix when it has no tokenizer file;
    None when it has one, or when trusted remote code declares its own tokenizer class."""
    folder = Path(folder)
    if any(next(folder.glob(pattern), None) for pattern in TOKENIZER_FILES):
        return None
    if trust_remote_code:
        try:
            auto_map = json.loads((folder / "tokenizer_config.json").read_text()).get("auto_map")
        except (OSError, ValueError, AttributeError):
            auto_map = None
        if isinstance(auto_map, dict) and "AutoTokenizer" in auto_map:
            return None  # the folder's own code decides which files it reads
    return (
        f"{folder}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}); copy the "
        "model's tokenizer files into this folder, or set target.path to the folder that has them"
    )


def load_chat_tokenizer(target: str | Path, trust_remote_code: bool = False):
    """The target's tokenizer; refuse a folder without tokenizer files or a tokenizer without a
    chat template."""
    from transformers import AutoTokenizer

    target = Path(target)
    if not target.is_dir():
        raise DataError(
            f"{target}: target folder not found; set target.path to a Hugging Face model folder"
        )
    problem = tokenizer_files_problem(target, trust_remote_code)
    if problem:
        raise DataError(problem)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        hint = (
            ""
            if trust_remote_code
            else " (set trust_remote_code: true if it ships tokenizer code you trust)"
        )
        raise DataError(f"{target}: cannot load the tokenizer: {_one_line(exc)}{hint}") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{target}: the tokenizer has no chat template; add chat_template.jinja (or "
            "'chat_template' in tokenizer_config.json) to the target folder"
        )
    return tokenizer


def _template_view(messages: list[dict]) -> list[dict]:
    """Messages with the reasoning also under `thinking`, the name some templates read."""
    return [
        {**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m
        for m in messages
    ]


def render(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> str:
    """The chat template's text for `messages` (may be empty: then only what precedes turns).

    `tools` goes to the template as its tool definitions; `template_kwargs` are the template's
    own switches (e.g. `enable_thinking`).
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    extra = {**tokenizer.special_tokens_map, **(template_kwargs or {})}
    try:
        # rendered directly: apply_chat_template refuses an empty conversation (an assistant
        # turn first has an empty prompt) and gives the same text otherwise
        texts, _ = render_jinja_template(
            conversations=[_template_view(messages)],
            tools=tools,
            chat_template=tokenizer.get_chat_template(tools=tools),
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
        return texts[0]
    except Exception as exc:  # jinja errors and raise_exception() in templates have many types
        raise RecordError(
            "template_error",
            f"rendering {len(messages)} messages failed: {type(exc).__name__}: {exc}",
        ) from exc


@dataclass
class Sample:
    """One training sample: the rendered text and the [start, end) character spans with loss."""

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
    reasoning_not_rendered: int = 0  # assistant turns whose reasoning the template left out


def _turn_span(before: str, upto: str) -> tuple[int, int]:
    # rstrip: the model stops at the end token, never generating the template's "\n" after it
    start = len(before)
    return start, start + len(upto[start:].rstrip())


def prefix_sample(tokenizer, conv: Conversation) -> Sample:
    """The whole rendering with every assistant turn's span, by prefix rendering."""
    messages, tools = conv.messages, conv.tools
    full = render(tokenizer, messages, tools=tools)
    spans, turns = [], []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        upto = render(tokenizer, messages[: i + 1], tools=tools)
        if not (full.startswith(before) and full.startswith(upto) and len(before) < len(upto)):
            which = "the prompt before" if not full.startswith(before) else "the conversation up to"
            raise RecordError(
                "template_error",
                f"not prefix-stable: {which} assistant turn {i} is not a "
                "prefix of the whole rendering",
            )
        spans.append(_turn_span(before, upto))
        turns.append(i)
    return Sample(full, spans, turns)


def per_turn_samples(tokenizer, conv: Conversation) -> list[Sample]:
    """Each assistant turn in the context of its generation: history as the template renders
    it before the turn (with the generation prompt), then the turn as the template renders the
    final turn. A turn joins the previous turn's sample when that sample's text up to its last
    span is exactly what precedes it, so a prefix-stable stretch costs one sample."""
    messages, tools = conv.messages, conv.tools
    samples: list[Sample] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        upto = render(tokenizer, messages[: i + 1], tools=tools)
        turn = (
            upto[len(before) :]
            if upto.startswith(before)
            else _final_turn(tokenizer, conv, i, before, upto)
        )
        if not turn.strip():
            raise RecordError("template_error", f"assistant turn {i} renders no text")
        text = before + turn
        span = _turn_span(before, text)
        last = samples[-1] if samples else None
        if last is not None and text.startswith(last.text[: last.spans[-1][1]]):
            samples[-1] = Sample(text, [*last.spans, span], [*last.turns, i])
        else:
            samples.append(Sample(text, [span], [i]))
    return samples


SENTINEL = "\u2063"  # invisible separator: marks where a final turn's own text begins


def _final_turn(tokenizer, conv: Conversation, i: int, before: str, upto: str) -> str:
    """The text of assistant turn `i` as the template renders it as the final turn, for a
    template that also re-renders the history once the turn exists (e.g. drops earlier
    reasoning): what follows the generation prompt in front of the turn's first own character.
    `before` and `upto`: the renderings up to the turn, with the generation prompt, and with it."""
    messages, tools = conv.messages, conv.tools
    history = render(tokenizer, messages[:i], tools=tools)
    marked = dict(messages[i])
    for key in ("content", "reasoning_content"):
        if key in marked:
            marked[key] = SENTINEL + marked[key]
    other = render(tokenizer, [*messages[:i], marked], tools=tools)
    differ = next((k for k, (a, b) in enumerate(zip(upto, other)) if a != b), len(upto))
    prompt = before[len(history) :] if before.startswith(history) else ""
    at = upto.rfind(prompt, 0, differ) if prompt else -1
    if at < 0:
        raise RecordError(
            "template_error",
            f"assistant turn {i} rendered as the final turn does not follow the generation "
            "prompt the template writes before it",
        )
    return upto[at + len(prompt) :]


def generation_sample(tokenizer, conv: Conversation) -> Sample:
    """The whole rendering with the spans the template marks with `{% generation %}`."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        texts, indices = render_jinja_template(
            conversations=[_template_view(conv.messages)],
            tools=conv.tools,
            chat_template=tokenizer.get_chat_template(tools=conv.tools),
            return_assistant_tokens_mask=True,
            **tokenizer.special_tokens_map,
        )
    except Exception as exc:  # noqa: BLE001 - template errors have many types
        raise RecordError(
            "template_error", f"rendering failed: {type(exc).__name__}: {exc}"
        ) from exc
    turns = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
    spans = sorted((a, b) for a, b in indices[0] if b > a)
    return Sample(texts[0], spans, turns)


INLINE_THINK = re.compile(r"^\s*<think>(.*?)</think>", re.S)


def reasoning_of(message: dict) -> str:
    """An assistant message's reasoning: reasoning_content, else a leading inline <think> block."""
    if message.get("reasoning_content"):
        return message["reasoning_content"].strip()
    inline = INLINE_THINK.match(message.get("content") or "")
    return inline.group(1).strip() if inline else ""


def _reasoning_excluded(sample: Sample, conv: Conversation) -> tuple[Sample, int]:
    """The sample with each trained turn's reasoning (and what precedes it in its span) out of
    the loss; the number of turns whose reasoning the rendering does not hold."""
    spans, missing, k = list(sample.spans), 0, 0
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
        else:
            missing += 1
    return Sample(sample.text, spans, sample.turns), missing


def masked_samples(tokenizer, conv: Conversation, settings: MaskSettings) -> Masked:
    """The training samples of one conversation under `settings.mode`; RecordError if the
    template fails (or, mode prefix, is not prefix-stable for it)."""
    mode = settings.mode
    if mode == "generation":
        samples = [generation_sample(tokenizer, conv)]
    elif mode == "per_turn":
        samples = per_turn_samples(tokenizer, conv)
    else:
        try:
            samples = [prefix_sample(tokenizer, conv)]
            mode = "prefix"
        except RecordError:
            if mode == "prefix":
                raise
            samples, mode = per_turn_samples(tokenizer, conv), "per_turn"
    excluded = [_reasoning_excluded(s, conv) for s in samples]
    missing = sum(n for _, n in excluded)
    if not settings.train_reasoning:
        samples = [s for s, _ in excluded]
    encoded = [_encode_with_offsets(tokenizer, s.text, s.spans) for s in samples]
    return Masked(encoded, mode, missing)


def _encode_with_offsets(
    tokenizer, text: str, spans: list[tuple[int, int]]
) -> tuple[list[int], list[int]]:
    """Token ids of `text` and, per token, 1 when the token starts inside one of `spans`."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        ids = list(enc["input_ids"])
        starts = [start for start, _ in enc["offset_mapping"]]
        mask, k = [], 0
        for start in starts:  # spans are sorted and disjoint; starts are non-decreasing
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            mask.append(int(k < len(spans) and spans[k][0] <= start))
        return ids, mask
    # Slow tokenizers (tiktoken-based remote code) give no offsets: encode the pieces between span
    # boundaries, valid only when they join to the whole text's encoding.
    ids, mask, pos = [], [], 0
    for a, b in spans:
        for piece, bit in ((text[pos:a], 0), (text[a:b], 1)):
            piece_ids = tokenizer.encode(piece, add_special_tokens=False) if piece else []
            ids += piece_ids
            mask += [bit] * len(piece_ids)
        pos = b
    tail = tokenizer.encode(text[pos:], add_special_tokens=False) if text[pos:] else []
    ids += tail
    mask += [0] * len(tail)
    if ids != list(tokenizer.encode(text, add_special_tokens=False)):
        raise RecordError(
            "template_error",
            "tokenizer gives no offsets and a token crosses an assistant "
            "span boundary; use a fast tokenizer (tokenizer.json)",
        )
    return ids, mask


def render_with_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and its assistant-only loss mask (same length),
    by prefix rendering; RecordError("template_error") when the template is not prefix-stable."""
    sample = prefix_sample(tokenizer, Conversation(messages))
    return _encode_with_offsets(tokenizer, sample.text, sample.spans)


def prompt_ids(tokenizer, conv: Conversation | list[dict]) -> list[int]:
    """The messages before the first assistant turn, rendered with the generation prompt."""
    if not isinstance(conv, Conversation):
        conv = Conversation(conv)
    first = next(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
    text = render(tokenizer, conv.messages[:first], add_generation_prompt=True, tools=conv.tools)
    return list(tokenizer.encode(text, add_special_tokens=False))


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


@dataclass(frozen=True)
class TemplateTraits:
    """What a template does with a multi-turn conversation with reasoning."""

    prefix_stable: bool  # rendering a prefix prefixes the whole rendering
    generation_marks: bool  # the template marks assistant text with {% generation %}
    renders_reasoning: bool  # the final turn's reasoning_content reaches the text
    auto_mode: str  # what data.mask_mode: auto does with conversations like the probe
    detail: str = ""

    def as_dict(self) -> dict:
        return {
            "prefix_stable": self.prefix_stable,
            "generation_marks": self.generation_marks,
            "renders_reasoning": self.renders_reasoning,
            "auto_mode": self.auto_mode,
        }


def template_traits(tokenizer) -> TemplateTraits:
    """Test the template once on PROBE (without its system turn if the template refuses one)."""
    marks = bool(GENERATION_MARK.search(tokenizer.get_chat_template()))
    error = None
    for probe in (PROBE, Conversation(PROBE.messages[1:])):
        try:
            return _probe_traits(tokenizer, probe, marks)
        except RecordError as err:
            error = err
    detail = f"the probe conversation does not render: {error.detail}"
    return TemplateTraits(False, marks, False, "per_turn", detail)


def _probe_traits(tokenizer, probe: Conversation, marks: bool) -> TemplateTraits:
    try:
        sample = prefix_sample(tokenizer, probe)
        stable, detail = True, ""
    except RecordError as err:
        if "not prefix-stable" not in err.detail:
            raise
        sample = per_turn_samples(tokenizer, probe)[-1]
        stable, detail = False, err.detail
    renders = probe.messages[-1]["reasoning_content"] in sample.text
    return TemplateTraits(stable, marks, renders, "prefix" if stable else "per_turn", detail)


def check_mode(traits: TemplateTraits, mode: str, where: str) -> None:
    """DataError when `mode` cannot work with this template at all (one line, with the fix)."""
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
