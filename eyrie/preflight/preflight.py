"""The preflight stage: CPU-only checks, in seconds, that gate every GPU-costly job.

Every problem is collected (not just the first), each with its fix; the report (preflight.json) is
written only when there is none, so a failed preflight leaves nothing for later rules to consume.
When vLLM is used (extract.backend: vllm or eval.vllm: true), eyrie.preflight.vllm_checks adds its
checks of the installed vLLM and the report a `vllm` object (docs/vllm.md, What preflight checks).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eyrie.arch.target import inspect_target, read_config, resolve_layer_ids
from eyrie.config.schema import merge_settings, vllm_uses
from eyrie.config.sections import VllmSettings
from eyrie.config.stages import PreflightSettings
from eyrie.core.errors import PreflightError, TargetError
from eyrie.core.io import keep_last_good, provenance, write_json
from eyrie.core.rehearsal import mark
from eyrie.preflight import vllm_checks as vllm_preflight
from eyrie.preflight.checks import (
    Check,
    HiddenVolume,
    check_storage,
    check_tokenizer,
    check_weights,
)
from eyrie.preflight.vllm_env import VllmEnvError, facts_for, vllm_python
from eyrie.store.fingerprint import content_digest
from eyrie.vllm.engine import EXTRACT_EXTRA

log = logging.getLogger(__name__)


def read_target(target: Path, trust: bool, check: Check):
    """The target's TargetInfo; code shipped with it is a problem unless trusted."""
    try:
        info = inspect_target(target)
    except TargetError as exc:
        raise PreflightError(str(exc)) from exc
    if info.needs_remote_code and not trust:
        check.problem(
            f"{target}: the config or tokenizer ships its own code (auto_map); set "
            "target.trust_remote_code: true if you trust this model folder"
        )
    return info


def layer_ids(aux_setting: list[int] | None, info, check: Check) -> tuple[list[int], int]:
    """(aux ids, final id); no aux ids when they do not resolve (a problem)."""
    try:
        return resolve_layer_ids(aux_setting, info.num_hidden_layers)
    except TargetError as exc:
        check.problem(str(exc))
        return [], info.num_hidden_layers


def training_tokens(tokenize_report: Path, check: Check) -> int:
    """Tokens of the training shards; shards without an assistant token are a problem."""
    report = json.loads(Path(tokenize_report).read_text())
    tokens = sum(int(s["tokens"]) for s in report["shards"])
    if sum(int(s["assistant_tokens"]) for s in report["shards"]) == 0:
        check.problem(
            f"{tokenize_report}: no assistant tokens in the training shards, so "
            "nothing can be learnt; check the data and the chat template"
        )
    return tokens


def engine_longest(tokenize_report: Path | None, loaded: dict) -> dict[str, int]:
    """The longest sequence of each vLLM engine of the run, from the tokenize report: extraction,
    the longest training sample + EXTRACT_EXTRA; the evaluation, the longest held-out prompt +
    eval.max_new_tokens + eval.num_speculative_tokens. A report made before these counts existed
    gives data.max_seq_len (every sample is cut to it)."""
    if tokenize_report is None:
        return {}
    report = json.loads(Path(tokenize_report).read_text())
    cut = int(report["max_seq_len"])
    sample = max((s.get("longest", cut) for s in report["shards"]), default=cut)
    longest = {"extraction": sample + EXTRACT_EXTRA}
    ev = loaded.get("eval") or {}
    prompt = (report.get("eval") or {}).get("longest_prompt", cut)
    longest["evaluation"] = (
        prompt + int(ev.get("max_new_tokens") or 0) + int(ev.get("num_speculative_tokens") or 0)
    )
    used = {"extract": "extraction", "eval": "evaluation"}
    return {used[u]: longest[used[u]] for u in vllm_uses(loaded)}


def target_entry(target: Path, info, tokenizer_hash: str | None) -> dict:
    """preflight.json's `target` object."""
    return {
        "path": str(Path(target).resolve()),
        "model_type": info.model_type,
        "wrapper_model_type": info.wrapper_model_type,
        "family": info.architecture.family,
        "num_hidden_layers": info.num_hidden_layers,
        "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
        "fingerprint": info.fingerprint,
        "tokenizer_hash": tokenizer_hash,
        # config, weights, tokenizer and code files by size and (sampled) content
        "content_digest": content_digest(target),
    }


def check_regenerate_env(loaded: dict, config: dict, check: Check) -> None:
    """regenerate.backend: vllm: the vLLM environment runs and imports vLLM (its jobs would fail
    only after their start, as the shell's "No such file or directory")."""
    try:
        vllm = VllmSettings.from_section(loaded.get("vllm"), PreflightError)
        facts_for(vllm_python(vllm), [config])
    except VllmEnvError as exc:
        check.problem(f"regenerate.backend: vllm: {exc}")


def preflight(target: Path, tokenize_report: Path | None, out_dir: Path, settings: dict) -> dict:
    """Every check, all problems at once (PreflightError); returns preflight.json's content."""
    check = Check([], [])
    # read from the checked copy; the provenance records `settings` as given
    cfg = PreflightSettings.from_settings(settings)
    loaded, trust = cfg.checked, cfg.trust_remote_code
    info = read_target(target, trust, check)
    aux_ids, final_id = layer_ids(cfg.aux_ids, info, check)
    tied = bool(info.text_config.get("tie_word_embeddings"))
    weights = check_weights(target, check, rehearsal=cfg.rehearsal, tied=tied)
    vllm_report = None
    if cfg.vllm_uses:
        # no path is chosen for layer ids that did not resolve (that problem is reported above)
        longest = engine_longest(tokenize_report, loaded)
        vllm_target = vllm_preflight.VllmTarget(target, info, aux_ids, final_id, longest)
        got = vllm_preflight.vllm_checks(vllm_target, loaded)
        check.problems += got["problems"]
        check.warnings += got["warnings"]
        vllm_report = got["report"]
    if cfg.regenerate_vllm:
        check_regenerate_env(loaded, read_config(target), check)
    tok_hash, template = None, None
    if not (info.needs_remote_code and not trust):
        kwargs = cfg.chat_template_kwargs
        tok_hash, template = check_tokenizer(target, trust, check, kwargs) or (None, None)
    storage = None
    if tokenize_report is not None:
        tokens = training_tokens(tokenize_report, check)
        volume = HiddenVolume(tokens, len(aux_ids) + 1, info.hidden_size, cfg.storage_dtype)
        storage = check_storage(volume, out_dir, check)
    if check.problems:
        raise PreflightError(
            f"preflight found {len(check.problems)} problem(s) for {target}:\n  "
            + "\n  ".join(check.problems)
        )
    return {
        "ok": True,
        "target": target_entry(target, info, tok_hash),
        "aux_layer_ids": aux_ids,
        "final_layer_id": final_id,
        "storage": storage,
        "weights": weights,
        "chat_template": template,
        "vllm": vllm_report,
        "warnings": check.warnings,
        "provenance": provenance(settings),
        **mark(cfg.rehearsal),  # the GPU stages after it run on random weights
    }


def add_arguments(p) -> None:
    """Its own arguments; --settings and --runtime are the CLI's (eyrie.cli)."""
    p.add_argument("--target", type=Path, required=True, help="target model folder")
    p.add_argument("--tokenize-report", type=Path, help="report.json of the tokenize stage")
    p.add_argument("--out", type=Path, required=True, help="preflight report (JSON)")


def run(args) -> int:
    settings = merge_settings(args.settings, args.runtime)
    report = preflight(args.target, args.tokenize_report, args.out.parent, settings)
    write_json(args.out, report)
    keep_last_good(args.out)
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
    template = report["chat_template"]
    if template is not None:
        log.info(
            "chat template: %s; data.mask_mode auto trains %s (docs/data.md#the-loss-mask)",
            "prefix-stable" if template["prefix_stable"] else "not prefix-stable",
            "whole conversations"
            if template["prefix_stable"]
            else "each assistant turn in the context it is generated in",
        )
    for warning in report["warnings"]:
        log.warning("%s", warning)
    if report["vllm"] is not None:
        log.info("preflight ok: %s", vllm_preflight.verdict(report["vllm"]))
    if not report["weights"]["checked"]:
        log.info("%s: %s", t["path"], report["weights"]["note"])
    if report.get("rehearsal"):
        log.info(
            "rehearsal: the vLLM engines will run %s with random weights (docs/rehearsal.md)",
            t["path"],
        )
    return 0
