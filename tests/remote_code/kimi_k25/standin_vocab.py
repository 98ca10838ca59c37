"""A stand-in vocabulary for the vendored Kimi K2.5 remote-code tokenizer of this folder.

The real vocabulary, the `tiktoken.model` of moonshotai/Kimi-K2.5 (163,584 base64-token/rank
lines, about 2.8 MB), is NOT vendored: `write_standin_tiktoken_model` writes a stand-in of the 256
single bytes (ranks 0..255, no merges) instead, and `standin_folder` assembles a loadable
tokenizer folder from it and the vendored files (see README.md). With the stand-in every byte of
text is one token, so token ids differ from the real model's; the rendered chat text (the
`apply_chat_template(..., tokenize=False)` string) does not, since the chat template and the
TypeScript tool declaration never look at the vocabulary.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The vendored files a tokenizer folder needs (tiktoken.model is written, not vendored).
VENDORED = ("tokenization_kimi.py", "tool_declaration_ts.py", "chat_template.jinja")
CONFIG = "tokenizer_config.json"

# The published config numbers its special tokens from the real vocabulary's size: the first
# special id, 163584 ([BOS]), is the count of the real tiktoken.model's base tokens.
PUBLISHED_NUM_BASE_TOKENS = 163584
STANDIN_NUM_BASE_TOKENS = 256
# TikTokenTokenizer reserves this many special ids after the base tokens (its
# num_reserved_special_tokens); every published special id falls inside that window.
NUM_RESERVED_SPECIAL_TOKENS = 256


def write_standin_tiktoken_model(folder: str | Path) -> Path:
    """Write a STAND-IN `tiktoken.model` into `folder` and return its path.

    This is not the real Kimi K2.5 vocabulary, which is not vendored: the file holds the 256
    single bytes as ranks 0..255 (one `base64(token) rank` line each, the format `tiktoken.load.
    load_tiktoken_bpe` reads) and no merges, so every byte of text is one token. Token ids therefore
    differ from the real model's; the text `apply_chat_template` renders does not."""
    path = Path(folder) / "tiktoken.model"
    lines = (f"{base64.b64encode(bytes([rank])).decode('ascii')} {rank}\n" for rank in range(256))
    path.write_text("".join(lines), encoding="ascii")
    return path


def standin_id(published_id: int) -> int:
    """The id a published special token gets next to the stand-in vocabulary: the stand-in's
    base-token count plus the token's offset from the published first special id."""
    offset = published_id - PUBLISHED_NUM_BASE_TOKENS
    if not 0 <= offset < NUM_RESERVED_SPECIAL_TOKENS:
        raise ValueError(f"{published_id} is not a special id of the published config")
    return STANDIN_NUM_BASE_TOKENS + offset


def standin_config(published: dict) -> dict:
    """The published tokenizer config with its special-token ids moved onto the stand-in
    vocabulary: the `added_tokens_decoder` keys, and any `*_token_id` integer that names one of
    them, become `standin_id(...)`. Token names and every other entry stay as published."""
    config = dict(published)
    decoder = published.get("added_tokens_decoder", {})
    config["added_tokens_decoder"] = {str(standin_id(int(i))): t for i, t in decoder.items()}
    published_ids = {int(i) for i in decoder}
    for key, value in published.items():
        if key.endswith("_token_id") and isinstance(value, int) and value in published_ids:
            config[key] = standin_id(value)
    return config


def standin_folder(dst: str | Path) -> Path:
    """Assemble a tokenizer folder in `dst` (created if missing) that
    `AutoTokenizer.from_pretrained(dst, trust_remote_code=True)` loads without network access:
    the vendored tokenizer code and chat template copied unchanged, the stand-in `tiktoken.model`
    of `write_standin_tiktoken_model`, and `tokenizer_config.json` rewritten by `standin_config`
    (special ids 163584+i become 256+i, all else as vendored). Returns `dst` as a Path."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in VENDORED:
        shutil.copyfile(HERE / name, dst / name)
    write_standin_tiktoken_model(dst)
    published = json.loads((HERE / CONFIG).read_text(encoding="utf-8"))
    (dst / CONFIG).write_text(
        json.dumps(standin_config(published), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return dst
