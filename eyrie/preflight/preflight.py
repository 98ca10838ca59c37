"""Preflight: CPU-only checks, in seconds, that gate every GPU-costly job.

Every problem is collected (not just the first), each with its fix. The report is written only
when there is none, so a failed preflight leaves nothing that downstream rules could consume.
When vLLM is used (extract.backend: vllm or eval.vllm: true), eyrie.vllm.preflight_checks adds its checks
of the installed vLLM and the report gains a `vllm` object (docs/vllm.md).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eyrie.arch.target import inspect_target, resolve_layer_ids
from eyrie.errors import PreflightError, TargetError
from eyrie.formats.codecs import STORAGE_DTYPES
from eyrie.io import provenance, write_json
from eyrie.preflight.checks import Check, check_storage, check_tokenizer, check_weights
from eyrie.vllm import preflight_checks as vllm_preflight

log = logging.getLogger(__name__)


def preflight(target: Path, tokenize_report: Path | None, out_dir: Path, settings: dict) -> dict:
    check = Check([], [])
    layers = settings.get("layers", {})
    extract = settings.get("extract", {})
    trust = bool(settings.get("trust_remote_code", False))
    try:
        info = inspect_target(target)
    except TargetError as exc:
        raise PreflightError(str(exc)) from exc
    if info.needs_remote_code and not trust:
        check.problem(
            f"{target}: the config or tokenizer ships its own code (auto_map); set "
            "target.trust_remote_code: true if you trust this model folder"
        )
    aux_ids: list[int] = []
    final_id = info.num_hidden_layers
    ids_ok = False
    try:
        aux_ids, final_id = resolve_layer_ids(layers.get("aux_ids"), info.num_hidden_layers)
        ids_ok = True
    except TargetError as exc:
        check.problem(str(exc))
    check_weights(target, check)
    vllm_report = None
    if vllm_preflight.uses(settings):
        # no path is chosen for layer ids that did not resolve (that problem is reported above)
        got = vllm_preflight.vllm_checks(
            target, info, aux_ids if ids_ok else [], final_id, settings
        )
        check.problems += got["problems"]
        check.warnings += got["warnings"]
        vllm_report = got["report"]
    tok_hash = None
    if not (info.needs_remote_code and not trust):
        tok_hash = check_tokenizer(target, trust, check)
    storage = None
    if tokenize_report is not None:
        report = json.loads(Path(tokenize_report).read_text())
        tokens = sum(int(s["tokens"]) for s in report["shards"])
        if sum(int(s["assistant_tokens"]) for s in report["shards"]) == 0:
            check.problem(
                f"{tokenize_report}: no assistant tokens in the training shards, so "
                "nothing can be learnt; check the data and the chat template"
            )
        dtype = extract.get("storage_dtype", "bfloat16")
        if dtype not in STORAGE_DTYPES:
            check.problem(f"extract.storage_dtype {dtype!r}: use one of {sorted(STORAGE_DTYPES)}")
        else:
            storage = check_storage(
                tokens, len(aux_ids) + 1, info.hidden_size, dtype, out_dir, check
            )
    if check.problems:
        raise PreflightError(
            f"preflight found {len(check.problems)} problem(s) for {target}:\n  "
            + "\n  ".join(check.problems)
        )
    return {
        "ok": True,
        "target": {
            "path": str(Path(target).resolve()),
            "model_type": info.model_type,
            "wrapper_model_type": info.wrapper_model_type,
            "family": info.architecture.family,
            "num_hidden_layers": info.num_hidden_layers,
            "hidden_size": info.hidden_size,
            "vocab_size": info.vocab_size,
            "fingerprint": info.fingerprint,
            "tokenizer_hash": tok_hash,
        },
        "aux_layer_ids": aux_ids,
        "final_layer_id": final_id,
        "storage": storage,
        "vllm": vllm_report,
        "warnings": check.warnings,
        "provenance": provenance(settings),
    }


def add_arguments(p) -> None:
    from eyrie.runtime import settings_arg

    p.add_argument("--target", type=Path, required=True, help="target model folder")
    p.add_argument("--tokenize-report", type=Path, help="report.json of the tokenize stage")
    p.add_argument("--out", type=Path, required=True, help="preflight report (JSON)")
    p.add_argument(
        "--settings",
        type=settings_arg,
        default={},
        help="JSON: the settings the workflow compares (layers, extract, trust_remote_code, vllm)",
    )
    p.add_argument(
        "--runtime",
        type=settings_arg,
        default={},
        help="JSON merged into --settings: what preflight reads but the workflow does not "
        "compare (eval.vllm, vllm.python, GPU memory)",
    )


def run(args) -> int:
    settings = vllm_preflight.merge_settings(args.settings, args.runtime)
    report = preflight(args.target, args.tokenize_report, args.out.parent, settings)
    write_json(args.out, report)
    t = report["target"]
    log.info(
        "preflight ok: %s (%s, %d layers, hidden %d), aux ids %s + final %d",
        t["path"],
        t["model_type"],
        t["num_hidden_layers"],
        t["hidden_size"],
        report["aux_layer_ids"],
        report["final_layer_id"],
    )
    for warning in report["warnings"]:
        log.warning("%s", warning)
    if report["vllm"] is not None:
        log.info("preflight ok: %s", vllm_preflight.verdict(report["vllm"]))
    return 0
