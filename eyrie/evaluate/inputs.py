"""The evaluate stage's inputs, checked before any model is loaded, and its models.

The settings (eyrie.config.stages.EvalSettings), the preflight report, the vocabulary map, the
prompts and the exported draft are each checked against the target (`check_inputs`: one error
naming the file and the fix); then the target is loaded (eyrie.arch.loader) and the trained draft
and an untrained baseline of its shape become proposers of its kind, EAGLE-3 or block
(`build_proposers`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eyrie.arch.methods import aux_key
from eyrie.config.stages import EvalSettings
from eyrie.core.errors import EvaluateError
from eyrie.core.rehearsal import draft_is_rehearsal, refusal
from eyrie.evaluate.specdec import BlockProposer, Eagle3Proposer
from eyrie.evaluate.vllm_check import block_width_problems, read_draft_config
from eyrie.formats.draft import is_block
from eyrie.formats.report import read_report
from eyrie.formats.tokenized import read_prompts
from eyrie.formats.vocab import read_vocab

log = logging.getLogger(__name__)


UNTRAINED_SEED = 0


def read_preflight(path: str | Path, fingerprint: str, num_layers: int) -> list[int]:
    """The preflight report's aux_layer_ids, after checking it passed and matches the target."""
    path = Path(path)
    report = read_report(path, fingerprint)
    aux = report.get("aux_layer_ids")
    if not (isinstance(aux, list) and aux and all(isinstance(i, int) for i in aux)):
        raise EvaluateError(
            f"{path}: aux_layer_ids must be a non-empty list of integers; rerun `eyrie preflight`"
        )
    if any(not 0 <= i < num_layers for i in aux):
        raise EvaluateError(
            f"{path}: aux_layer_ids {aux} must lie within 0..{num_layers - 1} for "
            f"a target with {num_layers} layers; rerun `eyrie preflight`"
        )
    if report.get("final_layer_id") != num_layers:
        raise EvaluateError(
            f"{path}: final_layer_id {report.get('final_layer_id')!r} but the target "
            f"has {num_layers} layers; rerun `eyrie preflight`"
        )
    return aux


def load_draft(path: str | Path):
    """The exported draft through speculators' own loader (sdpa attention: dense masks, any
    device), with its weights checked finite."""
    import warnings

    from eyrie.formats.draft import load_draft as load_exported

    path = Path(path)
    if not (path / "config.json").is_file():
        raise EvaluateError(f"{path}/config.json: not found; run `eyrie export` first")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            draft = load_exported(path)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise EvaluateError(
            f"{path}: speculators cannot load the draft ({first}); re-export it "
            "(its verifier.name_or_path must point at the target folder)"
        ) from exc
    for name, tensor in draft.state_dict().items():
        if name.startswith("verifier_"):
            continue  # training-only weights, unused at inference
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise EvaluateError(
                f"{path}: draft tensor {name!r} has non-finite values; re-export "
                "the draft from a finished training run"
            )
    return draft


def check_draft(
    draft, path, aux_ids: list[int], hidden_size: int, vocab_map: tuple[torch.Tensor, torch.Tensor]
) -> list[int]:
    """The draft must read aux layers the preflight chose (all, or some: train.aux_ids) and use
    this vocabulary map (`vocab_map`: d2t, t2d); returns the layers it reads."""
    d2t, t2d = vocab_map
    key = aux_key(draft.config.speculators_model_type)
    draft_aux = list(getattr(draft.config, key))
    if not set(draft_aux) <= set(aux_ids):
        raise EvaluateError(
            f"{path}: draft {key} {draft_aux} are not among "
            f"the preflight's aux_layer_ids {list(aux_ids)}; retrain/export "
            "the draft with the preflight's layers (or rerun preflight)"
        )
    if draft.hidden_size != hidden_size:
        raise EvaluateError(
            f"{path}: draft hidden size {draft.hidden_size} but the target's is "
            f"{hidden_size}; train the draft for this target"
        )
    if draft.draft_vocab_size != len(d2t):
        raise EvaluateError(
            f"{path}: draft_vocab_size {draft.draft_vocab_size} but the vocabulary "
            f"map has {len(d2t)} entries; use the draft trained with this map"
        )
    if draft.d2t is not None and not (
        torch.equal(draft.d2t.cpu(), d2t) and torch.equal(draft.t2d.cpu(), t2d)
    ):
        raise EvaluateError(
            f"{path}: the draft's d2t/t2d differ from the vocabulary map's; use "
            "the draft trained with this map"
        )
    return draft_aux


@dataclass(frozen=True)
class EvalPaths:
    """The stage's files, as given on the command line (written into the report as given)."""

    target: str | Path
    draft: str | Path  # exported draft folder
    vocab: str | Path  # vocab.safetensors (d2t, t2d)
    eval_set: str | Path  # eval.parquet with prompt_ids
    preflight: str | Path  # preflight.json
    out: str | Path  # eval.json to write
    plot: str | Path  # eval.png to write


@dataclass(frozen=True)
class EvalInputs:
    """The checked inputs: the preflight's aux ids, the vocabulary map, the prompts, the draft."""

    aux_ids: list[int]
    d2t: torch.Tensor
    t2d: torch.Tensor
    prompts: list  # (sample_id, prompt ids)
    draft: object  # speculators' Eagle3DraftModel, DFlashDraftModel or DSparkDraftModel


def check_inputs(paths: EvalPaths, cfg: EvalSettings) -> EvalInputs:
    """Every input checked against the target before any model is loaded."""
    from eyrie.arch.target import inspect_target
    from eyrie.core.errors import TargetError

    try:
        info = inspect_target(paths.target)
    except TargetError as exc:
        raise EvaluateError(str(exc)) from exc
    aux_ids = read_preflight(paths.preflight, info.fingerprint, info.num_hidden_layers)
    d2t, t2d = read_vocab(paths.vocab, info.vocab_size)
    prompts = read_prompts(paths.eval_set, cfg.num_prompts, info.vocab_size)
    if draft_is_rehearsal(paths.draft):
        fix = (
            "evaluate the draft of the run without vllm.rehearsal (results/<name>/draft); a "
            "rehearsal has no Hugging Face evaluation"
        )
        raise EvaluateError(refusal(Path(paths.draft) / "provenance.json", "a draft", fix))
    draft = load_draft(paths.draft)
    aux_ids = check_draft(draft, paths.draft, aux_ids, info.hidden_size, (d2t, t2d))
    width = block_width_problems(read_draft_config(Path(paths.draft)), cfg.K)
    if width:
        raise EvaluateError(f"{Path(paths.draft) / 'config.json'}: " + "; ".join(width))
    verifier = draft.config.speculators_config.verifier.name_or_path
    if verifier and Path(verifier).resolve() != Path(paths.target).resolve():
        log.warning(
            "draft's verifier.name_or_path is %s, evaluating against %s", verifier, paths.target
        )
    max_pos = info.text_config.get("max_position_embeddings")
    longest = max(len(p) for _, p in prompts) + cfg.max_new_tokens + cfg.K
    if isinstance(max_pos, int) and longest > max_pos:
        raise EvaluateError(
            f"{paths.eval_set}: longest prompt + eval.max_new_tokens + K = {longest} "
            f"exceeds the target's max_position_embeddings {max_pos}; lower "
            "eval.max_new_tokens"
        )
    return EvalInputs(aux_ids, d2t, t2d, prompts, draft)


def load_target(target: str | Path, device: str, dtype: str):
    """(the target in `dtype` on `device`, its tokenizer's eos id or None)."""
    from transformers import AutoTokenizer

    from eyrie.arch.loader import load_causal_lm

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        log.warning("the tokenizer has no eos token: decoding stops at max_new_tokens only")
    return load_causal_lm(target, device, dtype, False, EvaluateError), eos_id


def build_proposers(target: str | Path, inputs: EvalInputs, device: str, dtype: str) -> dict:
    """{"trained": the exported draft, "untrained": a fresh draft of the same shape (the
    baseline, seeded with UNTRAINED_SEED)} as EAGLE-3 proposers on `device` in `dtype` (the
    target's, as vLLM runs a draft)."""
    from eyrie.arch.draft import DraftSpec, build_draft

    draft = inputs.draft
    c = draft.config
    tl = c.transformer_layer_config
    common = dict(num_layers=tl.num_hidden_layers, draft_arch=tl.model_type)
    if is_block(draft):
        spec = DraftSpec(
            inputs.aux_ids,
            **common,
            method=c.speculators_model_type,
            block_size=c.block_size,
            mask_token_id=c.mask_token_id,
            sample_from_anchor=c.sample_from_anchor,
        )
        proposer = BlockProposer
    else:
        spec = DraftSpec(
            inputs.aux_ids,
            **common,
            norm_before_residual=c.norm_before_residual,
            norm_before_fc=c.norm_before_fc,
        )
        proposer = Eagle3Proposer
    untrained = build_draft(target, spec, inputs.d2t, inputs.t2d, seed=UNTRAINED_SEED)
    return {
        "trained": proposer(draft.to(device, getattr(torch, dtype))),
        "untrained": proposer(untrained.to(device, getattr(torch, dtype))),
    }
