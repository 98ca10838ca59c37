"""Build a fresh draft for a target folder with speculators' own model classes: EAGLE-3
(Eagle3DraftModel) or a block drafter (DFlashDraftModel, DSparkDraftModel: a block of tokens per
draft forward, from the same target layers).

`build_draft` loads the verifier's embeddings, final norm and lm_head from the target folder (a
rehearsal: random ones of their shapes, no weights read) and checks the vocabulary map against
its vocab_size; training and evaluation build their drafts with it, so an untrained draft has the
trained one's shape. Attention is sdpa (CPU and GPU) unless the
caller asks for speculators' flex attention (GPU training). `mask_token` picks the id a block
drafter feeds at the positions it predicts. docs/training.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from eyrie.arch.methods import BLOCK_METHODS, DRAFT_METHODS
from eyrie.arch.verifier import random_verifier_weights
from eyrie.core.errors import EyrieError


@dataclass(frozen=True)
class DraftSpec:
    """How a draft is built, besides its target and vocabulary map: the target layers it reads,
    its decoder layers and their kind, the norm placement, the TTT steps it trains over and its
    attention ("sdpa": dense masks, CPU and GPU; "simple_flex_attention": block masks that skip
    the masked blocks of packed documents and TTT steps, GPU training only)."""

    aux_layer_ids: Sequence[int]
    num_layers: int = 1
    draft_arch: str = "llama"
    norm_before_residual: bool = True
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states before fc
    ttt_steps: int = 3
    attn_impl: str = "sdpa"
    trust_remote_code: bool = False  # to read the target folder's config
    # a rehearsal (vllm.rehearsal): random embedding, lm_head and norm rows of the target's
    # shapes instead of its weights, which a rehearsal does not need on disk
    random_verifier: bool = False
    method: str = "eagle3"  # DRAFT_METHODS, as vLLM's speculative_config.method
    block_size: int = 8  # block drafters: the positions one draft forward predicts
    mask_token_id: int | None = None  # block drafters: the id fed at those positions
    sample_from_anchor: bool | None = None  # block drafters; None: the method's own default

    def __post_init__(self):
        if self.method not in DRAFT_METHODS:
            raise EyrieError(f"draft method {self.method!r}: one of {list(DRAFT_METHODS)}")
        if self.method in BLOCK_METHODS and self.mask_token_id is None:
            raise EyrieError(f"a {self.method} draft needs a mask token id (mask_token)")


def build_draft(
    target_path: str | Path,
    spec: DraftSpec,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    *,
    seed: int | None = None,
    device: torch.device | str | None = None,
):
    """A fresh (untrained) draft for the target at `target_path`, built as `spec` says.

    d2t: int64 [draft_vocab] offsets (target_id = i + d2t[i]); t2d: bool [target_vocab].
    Seeded when `seed` is given, so the same call builds the same weights (on one device kind).
    `device`: where its parameters are made and initialised (default: the CPU, whose modules
    initialise a target-wide embedding on one thread: BENCHMARKS.md); the verifier's rows are
    read on the CPU either way.
    """
    from speculators.train.cli import create_transformer_layer_config

    target_path = str(Path(target_path).resolve())
    verifier = AutoConfig.from_pretrained(target_path, trust_remote_code=spec.trust_remote_code)
    verifier = getattr(verifier, "text_config", None) or verifier
    if int(t2d.shape[0]) != verifier.vocab_size:
        raise EyrieError(
            f"vocabulary map has t2d of size {t2d.shape[0]} but the target's vocab_size "
            f"is {verifier.vocab_size}; rebuild the vocabulary map for this target"
        )
    if seed is not None:
        torch.manual_seed(seed)
    verifier_weights = random_verifier_weights(verifier) if spec.random_verifier else nullcontext()
    place = torch.device(device) if device is not None else nullcontext()
    with warnings.catch_warnings(), verifier_weights, place:
        warnings.simplefilter("ignore")
        layer_config = create_transformer_layer_config(
            verifier_name_or_path=target_path,
            num_layers=spec.num_layers,
            draft_arch=spec.draft_arch,
            hidden_act=None,
            sliding_window=2048,
            full_attention_indices=list(range(spec.num_layers)),
            trust_remote_code=spec.trust_remote_code,
        )
        common = dict(
            verifier_config=layer_config,
            t2d=t2d,
            d2t=d2t,
            verifier_name_or_path=target_path,
            draft_vocab_size=int(d2t.shape[0]),
            target_layer_ids=list(spec.aux_layer_ids),
            draft_attn_impl=spec.attn_impl,
            trust_remote_code=spec.trust_remote_code,
        )
        if spec.method in BLOCK_METHODS:
            return _model_class(spec.method).from_training_args(
                **common,
                block_size=spec.block_size,
                mask_token_id=spec.mask_token_id,
                sample_from_anchor=spec.sample_from_anchor,
                # every layer is full attention, which speculators trains bidirectional within
                # the block; vLLM (0.26+) runs a DFlash draft causal unless this is set
                sliding_window_non_causal=True,
            )
        return _model_class(spec.method).from_training_args(
            **common,
            norm_before_residual=spec.norm_before_residual,
            norm_before_fc=spec.norm_before_fc,
            ttt_steps=spec.ttt_steps,
        )


def _model_class(method: str):
    """speculators' draft class for a DRAFT_METHODS name, from its own registry (the names are
    the ones its classes register under, as vLLM's methods)."""
    from speculators import SpeculatorModel

    return SpeculatorModel.registry[method]


def mask_token(tokenizer, vocab_size: int, where: str) -> int:
    """The id a block drafter feeds at the positions it predicts, without changing the target's
    tokenizer: its mask token; else the first embedding row past its ids (a row no text reaches,
    as a mask must be); else its pad token when that is a token of its own (not bos, eos or unk:
    padding is never text); else one line naming the key to set. `where`: the target folder.

    speculators instead adds a `<|MASK|>` token to the tokenizer, which takes that same first
    free row when there is one."""
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    pad = tokenizer.pad_token_id
    others = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}
    if pad is not None and pad not in others:
        return int(pad)
    raise EyrieError(
        f"{where}: the tokenizer has no mask token, no pad token of its own, and its "
        f"{len(tokenizer)} ids fill the embedding's {vocab_size} rows, so a block drafter has "
        "no id to mark the positions it predicts; set train.mask_token_id to an id the data "
        "never holds (a reserved special token)"
    )
