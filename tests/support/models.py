"""The tiny models the tests build from configs (never downloaded): a Llama config of a few
layers, its random weights (optionally spread wider, for clear argmax margins), a target folder
with its tokenizer, and a random vocabulary map."""

from __future__ import annotations

from pathlib import Path

import torch

# What the tiny chat tokenizers of the extract and evaluate tests are trained on.
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "def f(x): return x + 1",
    "speculative decoding drafts tokens",
    "hidden states of the target model",
] * 8


def tiny_llama(vocab_size: int, tok=None, **fields):
    """A LlamaConfig of hidden 32, 4 layers, 4 heads (2 key/value), MLP 64 unless `fields` say
    otherwise; with `tok`, its bos/eos/pad token ids."""
    from transformers import LlamaConfig

    if tok is not None:
        fields = dict(
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            **fields,
        )
    shape = dict(
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    return LlamaConfig(vocab_size=vocab_size, **{**shape, **fields})


def config_only_llama(folder: Path, vocab_size: int) -> Path:
    """config.json of a 2-layer Llama (hidden 16) in `folder`: what the data stages read of a
    target (its vocabulary size), no weights."""
    tiny_llama(
        vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ).save_pretrained(folder)
    return folder


def spread_weights(model, std: float):
    """Every matrix of `model` drawn again from N(0, std): larger random weights give clear argmax
    margins and hidden states that differ clearly per layer."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
    return model


def random_model(config, std: float | None = None, seed: int = 0):
    """The model of `config` with random weights of torch seed `seed` (spread to N(0, std) with
    `std`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return model if std is None else spread_weights(model, std)


def save_target(path: Path, model, tok) -> Path:
    """A target folder: `model`'s weights and config with `tok`'s files."""
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def random_vocab_map(path: Path, tok, draft_vocab: int):
    """A random vocabulary map of `draft_vocab` entries that keeps eos, saved at `path`:
    (file, d2t, t2d)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    kept = torch.sort(torch.randperm(len(tok), generator=gen)[:draft_vocab]).values
    if tok.eos_token_id not in kept:
        kept[-1] = tok.eos_token_id
    kept = torch.sort(kept).values
    d2t = kept - torch.arange(draft_vocab)
    t2d = torch.zeros(len(tok), dtype=torch.bool)
    t2d[kept] = True
    save_file({"d2t": d2t, "t2d": t2d}, str(path))
    return path, d2t, t2d
