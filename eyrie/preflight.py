"""Preflight: CPU-only checks, in seconds, that gate every GPU-costly job.

Every problem is collected (not just the first), each with its fix. The report is written only
when there is none, so a failed preflight leaves nothing that downstream rules could consume.
When vLLM is used (extract.backend: vllm or eval.vllm: true), eyrie.vllm_preflight adds its checks
of the installed vLLM and the report gains a `vllm` object (docs/vllm.md).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from eyrie import EyrieError, vllm_preflight
from eyrie.io import provenance, write_json
from eyrie.shards import STORAGE_DTYPES, bytes_per_token
from eyrie.targets import TargetError, inspect_target, resolve_layer_ids, tokenizer_hash

log = logging.getLogger(__name__)

# A conversation every chat template must render with a non-empty assistant loss mask.
SAMPLE_CONVERSATIONS = [
    [
        {"role": "user", "content": "What does json.dumps do?"},
        {"role": "assistant", "content": "It serializes an object to a JSON formatted string."},
    ],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Eleven."},
    ],
]
DISK_HEADROOM = 1.10  # ask for 10% more than the estimate


class PreflightError(EyrieError):
    pass


@dataclass
class Check:
    problems: list[str]
    warnings: list[str]

    def problem(self, text: str) -> None:
        self.problems.append(text)


def check_weights(path: Path, check: Check) -> None:
    if list(path.glob("*.safetensors")):
        return
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        check.problem(f"{path}: weights are only in pickle files (.bin/.pt), which eyrie does not "
                      "load; convert them to safetensors (save_pretrained(..., safe_serialization=True))")
    else:
        check.problem(f"{path}: no *.safetensors weights found; point target.path at a complete "
                      "Hugging Face model folder")


def check_tokenizer(path: Path, trust_remote_code: bool, check: Check) -> str | None:
    from transformers import AutoTokenizer

    from eyrie.tokenize import render_with_mask

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any loader failure is reported with its type
        check.problem(f"{path}: tokenizer does not load ({type(exc).__name__}: {exc}); "
                      "check the tokenizer files or set target.trust_remote_code if it ships code")
        return None
    if not getattr(tok, "chat_template", None):
        check.problem(f"{path}: tokenizer has no chat template; add chat_template.jinja to the "
                      "target folder")
        return None
    for i, messages in enumerate(SAMPLE_CONVERSATIONS):
        try:
            ids, mask = render_with_mask(tok, messages)
        except EyrieError as exc:
            check.problem(f"{path}: chat template fails on sample conversation {i}: {exc}")
            continue
        if sum(mask) == 0:
            check.problem(f"{path}: chat template yields an all-zero assistant loss mask on sample "
                          f"conversation {i}; the template must render assistant turns so their "
                          "text can be located (see docs/tokenization)")
    return tokenizer_hash(path)


def check_storage(tokens: int, n_states: int, hidden: int, storage_dtype: str, where: Path,
                  check: Check) -> dict:
    # hidden states (+ float8_e4m3's two float32 scales) per token; input_ids and loss_mask add
    # 5 B more, not counted (<= 1% from hidden size 128 up)
    per_token = bytes_per_token(storage_dtype, n_states, hidden)
    need = per_token * tokens
    probe = where
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need * DISK_HEADROOM > free:
        check.problem(f"{probe}: hidden states need ~{need / 1e9:.2f} GB ({tokens} tokens x "
                      f"{per_token} B/token) but only {free / 1e9:.2f} GB are free; free disk, "
                      "use fewer conversations or a smaller extract.storage_dtype")
    return {"bytes_per_token": per_token, "tokens": tokens, "estimated_bytes": need,
            "free_bytes": free, "path": str(probe)}


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
        check.problem(f"{target}: the config or tokenizer ships its own code (auto_map); set "
                      "target.trust_remote_code: true if you trust this model folder")
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
        got = vllm_preflight.vllm_checks(target, info, aux_ids if ids_ok else [], final_id, settings)
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
            check.problem(f"{tokenize_report}: no assistant tokens in the training shards, so "
                          "nothing can be learnt; check the data and the chat template")
        dtype = extract.get("storage_dtype", "bfloat16")
        if dtype not in STORAGE_DTYPES:
            check.problem(f"extract.storage_dtype {dtype!r}: use one of {sorted(STORAGE_DTYPES)}")
        else:
            storage = check_storage(tokens, len(aux_ids) + 1, info.hidden_size, dtype, out_dir,
                                    check)
    if check.problems:
        raise PreflightError(
            f"preflight found {len(check.problems)} problem(s) for {target}:\n  "
            + "\n  ".join(check.problems))
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


def read_report(path: str | Path, fingerprint: str | None = None) -> dict:
    """A preflight report that passed; with `fingerprint`, one made for the target as it is now.

    The one reader of this stage's output, for every stage that is gated on it.
    """
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise PreflightError(f"{path}: preflight report not found; run `eyrie preflight` first") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise PreflightError(f"{path}: unreadable preflight report ({exc}); rerun `eyrie preflight`") from exc
    if not isinstance(report, dict) or report.get("ok") is not True:
        raise PreflightError(f"{path}: preflight did not pass (ok is not true); fix what it reports "
                             "and rerun `eyrie preflight`")
    have = (report.get("target") or {}).get("fingerprint")
    if fingerprint is not None and have != fingerprint:
        raise PreflightError(f"{path}: preflight is stale (target.fingerprint {have!r}, but the "
                             f"target's config.json now gives {fingerprint!r}); rerun it")
    return report


def add_arguments(p) -> None:
    from eyrie.cli import settings_arg

    p.add_argument("--target", type=Path, required=True, help="target model folder")
    p.add_argument("--tokenize-report", type=Path, help="report.json of the tokenize stage")
    p.add_argument("--out", type=Path, required=True, help="preflight report (JSON)")
    p.add_argument("--settings", type=settings_arg, default={},
                   help="JSON: the settings the workflow compares (layers, extract, trust_remote_code, vllm)")
    p.add_argument("--runtime", type=settings_arg, default={},
                   help="JSON merged into --settings: what preflight reads but the workflow does not "
                        "compare (eval.vllm, vllm.python, GPU memory)")


def run(args) -> int:
    settings = vllm_preflight.merge_settings(args.settings, args.runtime)
    report = preflight(args.target, args.tokenize_report, args.out.parent, settings)
    write_json(args.out, report)
    t = report["target"]
    log.info("preflight ok: %s (%s, %d layers, hidden %d), aux ids %s + final %d",
             t["path"], t["model_type"], t["num_hidden_layers"], t["hidden_size"],
             report["aux_layer_ids"], report["final_layer_id"])
    for warning in report["warnings"]:
        log.warning("%s", warning)
    if report["vllm"] is not None:
        log.info("preflight ok: %s", vllm_preflight.verdict(report["vllm"]))
    return 0
