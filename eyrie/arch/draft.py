"""Build a fresh EAGLE-3 draft: speculators' own Eagle3DraftModel for a target folder.

`build_draft` loads the verifier's embeddings, final norm and lm_head from the target folder (a
rehearsal: random ones of their shapes, no weights read) and checks the vocabulary map against
its vocab_size; training and evaluation build their drafts with it, so an untrained draft has the
trained one's shape. Attention is sdpa (CPU and GPU) unless the
caller asks for speculators' flex attention (GPU training). docs/training.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from eyrie.core.errors import EyrieError
from eyrie.formats.draft import random_verifier_weights


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


def build_draft(
    target_path: str | Path,
    spec: DraftSpec,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    *,
    seed: int | None = None,
):
    """A fresh (untrained) draft for the target at `target_path`, built as `spec` says.

    d2t: int64 [draft_vocab] offsets (target_id = i + d2t[i]); t2d: bool [target_vocab].
    Seeded when `seed` is given, so the same call builds the same weights.
    """
    from speculators.models.eagle3 import Eagle3DraftModel
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
    with warnings.catch_warnings(), verifier_weights:
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
        model = Eagle3DraftModel.from_training_args(
            verifier_config=layer_config,
            t2d=t2d,
            d2t=d2t,
            verifier_name_or_path=target_path,
            draft_vocab_size=int(d2t.shape[0]),
            norm_before_residual=spec.norm_before_residual,
            norm_before_fc=spec.norm_before_fc,
            ttt_steps=spec.ttt_steps,
            target_layer_ids=list(spec.aux_layer_ids),
            draft_attn_impl=spec.attn_impl,
            trust_remote_code=spec.trust_remote_code,
        )
    return model
