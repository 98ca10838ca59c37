"""A sample's text -> token ids and loss mask: the tokens that start inside an assistant span
are trained. `encode_head` encodes only a head of a text far longer than the sample can be
(eyrie.chat.samples.masked_samples with max_tokens: data.max_seq_len).
"""

from __future__ import annotations

from eyrie.chat.records import RecordError

HEAD_CHARS_PER_TOKEN = 16  # the first cut of a long text: this many characters per token kept


def encode_head(tokenizer, text: str, spans: list, max_tokens: int | None) -> tuple:
    """`encode_with_offsets` of `text`, or, when `text` is far longer than `max_tokens` tokens
    can be, of a head of it: tokenizing a whole 60 MB record took 24 GB of memory to keep 2,048
    tokens. A head of C characters is used when its first max_tokens ids equal those of the
    head of 2C characters (a cut changes only the tokens near it) and there are more of them;
    otherwise C doubles, up to the whole text. Every id returned past max_tokens is a real
    token of the text, so a sample is still counted as cut."""
    cut = HEAD_CHARS_PER_TOKEN * max_tokens if max_tokens else len(text)
    head = None
    while 2 * cut < len(text):
        ids, mask = head or encode_with_offsets(tokenizer, text[:cut], _clipped(spans, cut))
        head = encode_with_offsets(tokenizer, text[: 2 * cut], _clipped(spans, 2 * cut))
        if len(ids) > max_tokens and ids[:max_tokens] == head[0][:max_tokens]:
            return ids[: max_tokens + 1], mask[: max_tokens + 1]
        cut *= 2  # the longer head, encoded already, is the next one tried
    return encode_with_offsets(tokenizer, text, spans)


def _clipped(spans: list, end: int) -> list:
    return [(a, min(b, end)) for a, b in spans if a < end]


def encode_with_offsets(
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
