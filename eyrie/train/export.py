"""Export the trained draft as the folder vLLM loads (docs/export-format.md).

The folder is built under a temporary name, then validated with speculators' own loader
(`Eagle3DraftModel.from_pretrained`): the tensor names and shapes must be exactly the expected
set, every config field must be explicit, and the loaded model's logits must be bit-identical to
the trained model's on a random packed batch. Only then is it renamed into place.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from eyrie.arch.target import fingerprint, read_config
from eyrie.errors import ExportError
from eyrie.formats.draft import (
    DRAFT_ARCHS,
    UNSERVABLE_FLAGS,
    expected_tensors,
    load_draft,
    validate_export,
)
from eyrie.io import atomic_path, provenance, write_json
from eyrie.train.config import TrainSettings

log = logging.getLogger(__name__)


def export(
    target: str | Path,
    train_dir: str | Path,
    out_dir: str | Path,
    settings: dict,
    *,
    num_speculative_tokens: int | None = None,
) -> dict:
    """Write `out_dir` (config.json, config.py, model.safetensors, provenance.json)."""
    from speculators.config import VerifierConfig

    cfg = TrainSettings.from_settings(settings)
    K = num_speculative_tokens if num_speculative_tokens is not None else cfg.ttt_steps
    if K < 1:
        raise ExportError(f"--num-speculative-tokens {K}: must be >= 1")
    target, train_dir, out_dir = Path(target).resolve(), Path(train_dir), Path(out_dir)
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
            f"vLLM serves EAGLE-3 drafts of type {', '.join(DRAFT_ARCHS)}"
        )
    summary = json.loads(summary_path.read_text())
    target_config = read_config(target)
    have_fp, trained_fp = fingerprint(target_config), summary.get("target", {}).get("fingerprint")
    if have_fp != trained_fp:
        raise ExportError(
            f"{summary_path}: the draft was trained for target fingerprint {trained_fp} "
            f"but {target} has {have_fp}; export against the target it was trained for"
        )

    reference = load_draft(draft_dir, verifier=target)
    verifier = VerifierConfig.from_pretrained(str(target))
    hidden = reference.hidden_size
    c = reference.config
    c.target_hidden_size = hidden
    c.speculators_config.verifier = VerifierConfig(
        name_or_path=str(target), architectures=verifier.architectures
    )
    proposal = c.speculators_config.proposal_methods[0]
    proposal.speculative_tokens = K
    expect_config = {
        "speculators_model_type": "eagle3",
        "transformer_layer_config.model_type": arch,
        "target_hidden_size": hidden,
        "draft_vocab_size": reference.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(summary["aux_layer_ids"]),
        "norm_output": False,
        "fc_norm": False,
        "speculators_config.algorithm": "eagle3",
        "speculators_config.default_proposal_method": "greedy",
        "speculators_config.proposal_methods.0.proposal_type": "greedy",
        "speculators_config.proposal_methods.0.speculative_tokens": K,
        "speculators_config.verifier.name_or_path": str(target),
        "speculators_config.verifier.architectures": list(verifier.architectures),
    }
    with atomic_path(out_dir) as tmp:
        reference.save_pretrained(tmp)
        validate_export(tmp, reference, K, expect_config)
        write_json(
            tmp / "provenance.json",
            {
                "trained_in": str(train_dir.resolve()),
                "train_run_id": summary.get("run_id"),
                "target": {"path": str(target), "fingerprint": have_fp},
                "num_speculative_tokens": K,
                "tensors": expected_tensors(reference),
                **provenance(settings),
            },
        )
    log.info(
        "exported %s (K=%d, %d tensors, verifier %s); loads in speculators with identical outputs",
        out_dir,
        K,
        len(expected_tensors(reference)),
        target,
    )
    return {"out_dir": str(out_dir), "num_speculative_tokens": K}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eyrie.runtime import settings_arg

    parser.add_argument(
        "--target",
        required=True,
        type=Path,
        help="target model folder (written as the verifier path, absolute)",
    )
    parser.add_argument("--train-dir", required=True, type=Path, help="results/<name>/train")
    parser.add_argument("--out-dir", required=True, type=Path, help="results/<name>/draft")
    parser.add_argument("--settings", required=True, type=settings_arg, help='{"train": {...}}')
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
    )
    return 0
