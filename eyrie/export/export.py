"""Export the trained draft as the folder vLLM loads (docs/export-format.md).

The folder is built under a temporary name, then validated with speculators' own loader
(`Eagle3DraftModel.from_pretrained`): the tensor names and shapes must be exactly the expected
set, every config field must be explicit, and the loaded model's logits must be bit-identical to
the trained model's on a random packed batch. Only then is it renamed into place as a new
version under drafts/, and the link `draft` pointed at it (eyrie.formats.versions): a failed
export leaves the last good draft where `vllm serve` finds it.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from eyrie.arch.methods import BLOCK_METHODS, aux_key
from eyrie.arch.target import fingerprint, read_config
from eyrie.arch.verifier import random_verifier_weights
from eyrie.config.sections import TrainSettings
from eyrie.core.errors import ExportError
from eyrie.core.io import provenance, write_json
from eyrie.core.rehearsal import is_rehearsal, mark, marked, refuse_in_real_run
from eyrie.formats.draft import (
    DRAFT_ARCHS,
    UNSERVABLE_FLAGS,
    expected_tensors,
    load_draft,
    validate_export,
)
from eyrie.formats.versions import DraftVersions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainedDraft:
    """A training run's draft folder and summary, checked to be a draft vLLM serves as trained."""

    train_dir: Path
    draft_dir: Path  # train_dir/draft
    arch: str  # transformer_layer_config.model_type
    summary: dict  # train.json


def read_trained(train_dir: Path, cfg: TrainSettings) -> TrainedDraft:
    """The run in `train_dir`: its files present, the kind of draft `cfg` names (train.method),
    no flag vLLM ignores, a layer type vLLM serves."""
    draft_dir, summary_path = train_dir / "draft", train_dir / "train.json"
    for path in (draft_dir / "config.json", draft_dir / "model.safetensors", summary_path):
        if not path.is_file():
            raise ExportError(f"{path}: not found; run eyrie train first")
    trained = json.loads((draft_dir / "config.json").read_text())
    for flag, reason in UNSERVABLE_FLAGS.items():
        if trained.get(flag):
            raise ExportError(
                f"{draft_dir / 'config.json'}: {flag} is true, but {reason}; "
                f"retrain with {flag} off"
            )
    arch = (trained.get("transformer_layer_config") or {}).get("model_type")
    if arch not in DRAFT_ARCHS:
        raise ExportError(
            f"{draft_dir / 'config.json'}: transformer_layer_config.model_type {arch!r}; "
            f"vLLM serves drafts of type {', '.join(DRAFT_ARCHS)}"
        )
    method = trained.get("speculators_model_type")
    if method != cfg.method:
        raise ExportError(
            f"{draft_dir / 'config.json'}: speculators_model_type {method!r}, but train.method "
            f"is {cfg.method}; retrain with this config (snakemake reruns train_draft when "
            "train.method changes)"
        )
    summary = json.loads(summary_path.read_text())
    return TrainedDraft(train_dir, draft_dir, arch, summary)


def check_rehearsal(trained: TrainedDraft, rehearsal: bool) -> bool:
    """Whether the draft is a rehearsal's; a real export (`rehearsal` false) refuses a
    rehearsal's training."""
    found = trained.train_dir / "train.json" if marked(trained.summary) and not rehearsal else None
    refuse_in_real_run(found, "a training", "export the training", "train", "export", ExportError)
    return rehearsal or marked(trained.summary)


def check_target(trained: TrainedDraft, target: Path) -> str:
    """The target's fingerprint, which must be the one the draft was trained for."""
    have_fp = fingerprint(read_config(target))
    trained_fp = trained.summary.get("target", {}).get("fingerprint")
    if have_fp != trained_fp:
        raise ExportError(
            f"{trained.train_dir / 'train.json'}: the draft was trained for target fingerprint "
            f"{trained_fp} but {target} has {have_fp}; export against the target it was trained "
            "for"
        )
    return have_fp


def configure(reference, target: Path, K: int) -> list[str]:
    """Set what the export writes beyond the trained config: the target hidden size, the
    verifier (the target, absolute) and K; returns the verifier's architectures."""
    from speculators.config import VerifierConfig

    verifier = VerifierConfig.from_pretrained(str(target))
    c = reference.config
    c.target_hidden_size = reference.hidden_size
    c.speculators_config.verifier = VerifierConfig(
        name_or_path=str(target), architectures=verifier.architectures
    )
    c.speculators_config.proposal_methods[0].speculative_tokens = K
    return verifier.architectures


def expected_config(
    reference, trained: TrainedDraft, target: Path, K: int, architectures: list[str]
) -> dict:
    """Dotted config.json key -> the value the export must hold (validate_export checks it)."""
    c = reference.config
    method = c.speculators_model_type
    if method in BLOCK_METHODS:
        own = {
            "block_size": c.block_size,
            "mask_token_id": c.mask_token_id,
            "sample_from_anchor": c.sample_from_anchor,
        }
    else:
        own = {"norm_output": False, "fc_norm": False}
    return {
        "speculators_model_type": method,
        "transformer_layer_config.model_type": trained.arch,
        "target_hidden_size": reference.hidden_size,
        "draft_vocab_size": reference.draft_vocab_size,
        aux_key(method): list(trained.summary["aux_layer_ids"]),
        **own,
        "speculators_config.algorithm": method,
        "speculators_config.default_proposal_method": "greedy",
        "speculators_config.proposal_methods.0.proposal_type": "greedy",
        "speculators_config.proposal_methods.0.speculative_tokens": K,
        "speculators_config.verifier.name_or_path": str(target),
        "speculators_config.verifier.architectures": list(architectures),
    }


def export(
    target: str | Path,
    train_dir: str | Path,
    out_dir: str | Path,
    settings: dict,
    *,
    num_speculative_tokens: int | None = None,
    manifest: str | Path | None = None,
) -> dict:
    """Write a new draft version (config.json, config.py, model.safetensors, provenance.json)
    beside `out_dir`, check it, then point the link `out_dir` at it and write `manifest`."""
    cfg = TrainSettings.from_settings(settings)
    K = num_speculative_tokens if num_speculative_tokens is not None else cfg.positions
    if K < 1:
        raise ExportError(f"--num-speculative-tokens {K}: must be >= 1")
    target, train_dir, out_dir = Path(target).resolve(), Path(train_dir), Path(out_dir)
    trained = read_trained(train_dir, cfg)
    if cfg.block and K > cfg.positions:
        raise ExportError(
            f"--num-speculative-tokens {K}: a {cfg.method} draft proposes at most "
            f"{cfg.positions} tokens per forward (train.block_size {cfg.block_size}, "
            f"train.sample_from_anchor {cfg.sample_from_anchor}); give at most {cfg.positions}"
        )
    rehearsal = check_rehearsal(trained, is_rehearsal(settings))
    have_fp = check_target(trained, target)
    # a rehearsal's target may have no weights yet: random verifier rows of its shapes
    with _verifier_weights(target, rehearsal):
        return _export(
            trained, (target, train_dir, out_dir), K, settings, rehearsal, have_fp, manifest
        )


def _verifier_weights(target: Path, rehearsal: bool):
    from contextlib import nullcontext

    from transformers import AutoConfig

    if not rehearsal:
        return nullcontext()
    config = AutoConfig.from_pretrained(str(target))
    return random_verifier_weights(getattr(config, "text_config", None) or config)


def _export(trained, paths, K, settings, rehearsal, have_fp, manifest) -> dict:
    target, train_dir, out_dir = paths
    start = time.monotonic()
    reference = load_draft(trained.draft_dir, verifier=target)
    loaded = time.monotonic()
    architectures = configure(reference, target, K)
    expect = expected_config(reference, trained, target, K, architectures)
    versions = DraftVersions(out_dir)
    with versions.new() as tmp:
        reference.save_pretrained(tmp)
        validate_export(tmp, reference, K, expect)
        write_json(
            tmp / "provenance.json",
            {
                "trained_in": str(train_dir.resolve()),
                "train_run_id": trained.summary.get("run_id"),
                "target": {"path": str(target), "fingerprint": have_fp},
                "num_speculative_tokens": K,
                "tensors": expected_tensors(reference),
                **provenance(settings),
                **mark(rehearsal),  # what the evaluations read to refuse it as real
            },
        )
    version = versions.publish()
    log.info(
        "exported %s -> %s (K=%d, %d tensors, verifier %s); loads in speculators with "
        "identical outputs (loaded in %.1f s, written and checked in %.1f s)",
        out_dir,
        version,
        K,
        len(expected_tensors(reference)),
        target,
        loaded - start,
        time.monotonic() - loaded,
    )
    done = {
        "out_dir": str(out_dir),
        "version": str(version),
        "files": versions.files,
        "num_speculative_tokens": K,
        "train_run_id": trained.summary.get("run_id"),
        **mark(rehearsal),
    }
    if manifest is not None:
        write_json(manifest, done)
    return done


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        required=True,
        type=Path,
        help="target model folder (written as the verifier path, absolute)",
    )
    parser.add_argument("--train-dir", required=True, type=Path, help="results/<name>/train")
    parser.add_argument(
        "--out-dir",
        required=True,
        type=Path,
        help="results/<name>/draft: the link to the newest good version (in the drafts/ beside it)",
    )
    parser.add_argument(
        "--manifest", type=Path, default=None, help="results/<name>/draft.json, written last"
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="K written in the config (default: train.ttt_steps)",
    )


def run(args: argparse.Namespace) -> int:
    export(
        args.target,
        args.train_dir,
        args.out_dir,
        args.settings,
        num_speculative_tokens=args.num_speculative_tokens,
        manifest=args.manifest,
    )
    return 0
