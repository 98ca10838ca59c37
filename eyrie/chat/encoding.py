"""A sample's pieces -> token ids and loss mask. Each piece (a context stretch or a turn the model
generates) is encoded on its own, as a server encodes its prompt and the model writes its
tokens after it, so no token crosses a turn's boundary; a trained piece's tokens carry loss.
`encode_head` encodes only a head of a text far longer than the sample can be
(eyrie.chat.samples.masked_samples with max_tokens: data.max_seq_len).
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

HEAD_CHARS_PER_TOKEN = 16  # the first cut of a long text: this many characters per token kept


def encode(tokenizer, text: str) -> list[int]:
    """The text's token ids, without added special tokens: what the template renders is what
    the model sees."""
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def encode_many(tokenizer, texts: list[str], max_tokens: int | None = None) -> list[list[int]]:
    """`encode_head` of each text: those short enough to encode whole go to a fast tokenizer in
    one call (a call costs more than a short text's tokens)."""
    limit = None if max_tokens is None else 2 * HEAD_CHARS_PER_TOKEN * max_tokens
    out: list[list[int]] = [[] for _ in texts]
    short = []
    for k, text in enumerate(texts):
        if text and limit is not None and len(text) > limit:
            out[k] = encode_head(tokenizer, text, max_tokens)
        elif text:
            short.append(k)
    if short and getattr(tokenizer, "is_fast", False):
        batch = tokenizer([texts[k] for k in short], add_special_tokens=False)["input_ids"]
        for k, ids in zip(short, batch):
            out[k] = list(ids)
    else:
        for k in short:
            out[k] = encode(tokenizer, texts[k])
    return out


def encode_head(tokenizer, text: str, max_tokens: int | None) -> list[int]:
    """`encode(text)`, or, when `text` is far longer than `max_tokens` tokens can be, the ids of
    a head of it: tokenizing a whole 60 MB record took 24 GB of memory to keep 2,048 tokens. A
    head of C characters is used when its first max_tokens ids equal those of the head of 2C
    characters (a cut changes only the tokens near it) and there are more of them; otherwise C
    doubles, up to the whole text. Every id returned past max_tokens is a real token of the
    text, so a sample is still counted as cut."""
    cut = HEAD_CHARS_PER_TOKEN * max_tokens if max_tokens else len(text)
    head = None
    while 2 * cut < len(text):
        ids = head or encode(tokenizer, text[:cut])
        head = encode(tokenizer, text[: 2 * cut])
        if len(ids) > max_tokens and ids[:max_tokens] == head[:max_tokens]:
            return ids[: max_tokens + 1]
        cut *= 2  # the longer head, encoded already, is the next one tried
    return encode(tokenizer, text)


class Piece(NamedTuple):
    """A stretch of a sample: its text, whether it is trained, and, for a turn the target
    generated (regeneration), the exact ids it generated."""

    text: str
    trained: bool
    ids: tuple[int, ...] | None = None


def ids_digest(ids: list[int]) -> str:
    """A short digest of token ids: a regenerated turn's prompt, to know its ids still follow
    the prompt they were generated after."""
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:16]


def encode_pieces(
    tokenizer, pieces: list[Piece], max_tokens: int | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of the pieces, one after another (a piece's exact ids where it has them), and
    per token 1 when its piece is trained. With `max_tokens`, the pieces past that many tokens
    are left out (one id past it is kept, so the sample still counts as cut)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trained, exact in pieces:
        room = None if max_tokens is None else max_tokens - len(ids)
        if room is not None and room <= 0:
            break
        piece = list(exact) if exact is not None else encode_head(tokenizer, text, room)
        ids += piece
        mask += [int(trained)] * len(piece)
        if max_tokens is not None and len(ids) > max_tokens:
            return ids[: max_tokens + 1], mask[: max_tokens + 1]
    return ids, mask


def same_ids(a: list[int], b: list[int], max_tokens: int | None = None) -> bool:
    """Whether ids `a` and `b` are equal (in their first max_tokens ids where given: what lies
    past them is cut from every sample)."""
    return a[:max_tokens] == b[:max_tokens] if max_tokens is not None else a == b
