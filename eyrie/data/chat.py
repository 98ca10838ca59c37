"""The target's chat template as token ids and an assistant-only loss mask.

`load_chat_tokenizer` loads the target's tokenizer (refusing one without a chat template);
`render_with_mask` renders a conversation and marks the tokens of its assistant turns by prefix
rendering, which needs a prefix-stable template (RecordError "template_error" otherwise);
`prompt_ids` is the prompt before the first assistant turn. docs/data.md#the-loss-mask.
"""

from __future__ import annotations

from pathlib import Path

from eyrie.data.records import RecordError, _one_line
from eyrie.errors import DataError


def load_chat_tokenizer(target: str | Path, trust_remote_code: bool = False):
    """The target's tokenizer; refuse one without a chat template."""
    from transformers import AutoTokenizer

    target = Path(target)
    if not target.is_dir():
        raise DataError(
            f"{target}: target folder not found; set target.path to a Hugging Face model folder"
        )
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


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template's text for `messages` (may be empty: then only what precedes turns)."""
    try:
        if messages:
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        # a conversation that opens with an assistant turn has an empty prompt, which
        # apply_chat_template refuses: render the same template directly
        from transformers.utils.chat_template_utils import render_jinja_template

        texts, _ = render_jinja_template(
            conversations=[[]],
            chat_template=tokenizer.get_chat_template(),
            add_generation_prompt=add_generation_prompt,
            **tokenizer.special_tokens_map,
        )
        return texts[0]
    except Exception as exc:  # jinja errors and raise_exception() in templates have many types
        raise RecordError(
            "template_error",
            f"rendering {len(messages)} messages failed: {type(exc).__name__}: {exc}",
        ) from exc


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character span of every assistant turn in it."""
    full = render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1])
        if not (full.startswith(before) and full.startswith(upto) and len(before) < len(upto)):
            which = "the prompt before" if not full.startswith(before) else "the conversation up to"
            raise RecordError(
                "template_error",
                f"not prefix-stable: {which} assistant turn {i} is not a "
                "prefix of the whole rendering",
            )
        # rstrip: the model stops at the end token, never generating the template's "\n" after it
        start = len(before)
        spans.append((start, start + len(full[start : len(upto)].rstrip())))
    return full, spans


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
    """Token ids of the rendered conversation and its assistant-only loss mask (same length).

    `messages`: `[{"role": "system"|"user"|"assistant", "content": str}, ...]`. The mask is 1 on
    tokens starting inside an assistant turn's span (content and end-of-turn token). Not truncated.
    Raises RecordError("template_error") when the template is not prefix-stable.
    """
    full, spans = assistant_spans(tokenizer, messages)
    return _encode_with_offsets(tokenizer, full, spans)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The messages before the first assistant turn, rendered with the generation prompt."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    text = render(tokenizer, messages[:first], add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))
