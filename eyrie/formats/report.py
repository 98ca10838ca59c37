"""The preflight report's reader: preflight.json, for every stage gated on it.

`read_report` returns the report only when it passed (`ok` is true) and, given the target's
fingerprint, only when it was made for the target as it is now. `identity` is what in a report
determines the outputs made under it (the stores' keys and training's run id use it). The file:
docs/contracts.md#files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eyrie.core.errors import EyrieError, PreflightError
from eyrie.core.rehearsal import marked


def read_report(path: str | Path, fingerprint: str | None = None) -> dict:
    """A preflight report that passed; with `fingerprint`, one made for the target as it is now."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise PreflightError(
            f"{path}: preflight report not found; run `eyrie preflight` first"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise PreflightError(
            f"{path}: unreadable preflight report ({exc}); rerun `eyrie preflight`"
        ) from exc
    if not isinstance(report, dict) or report.get("ok") is not True:
        raise PreflightError(
            f"{path}: preflight did not pass (ok is not true); fix what it reports "
            "and rerun `eyrie preflight`"
        )
    have = (report.get("target") or {}).get("fingerprint")
    if fingerprint is not None and have != fingerprint:
        raise PreflightError(
            f"{path}: preflight is stale (target.fingerprint {have!r}, but the "
            f"target's config.json now gives {fingerprint!r}); rerun it"
        )
    return report


# the chat template's traits an identity hashes: those preflight reported when identities were
# first kept (traits added since, such as the tool-argument form, would change every finished
# run's store keys and training run id)
IDENTITY_TEMPLATE_TRAITS = ("prefix_stable", "generation_marks", "renders_reasoning", "auto_mode")


def identity(report: dict) -> str:
    """sha256 of what in a report determines the outputs made under it: the target as content
    (not where it lies), the layer ids, the chat template, the vLLM version and extraction path,
    a rehearsal's mark; not its time, host, free disk or warnings (a rerun of preflight changes
    those alone)."""
    target = {k: v for k, v in (report.get("target") or {}).items() if k != "path"}
    vllm = report.get("vllm") or {}
    template = report.get("chat_template")
    if isinstance(template, dict):  # the traits finished runs' identities hashed, no later ones
        template = {k: v for k, v in template.items() if k in IDENTITY_TEMPLATE_TRAITS}
    kept = {
        "target": target,
        "aux_layer_ids": report.get("aux_layer_ids"),
        "final_layer_id": report.get("final_layer_id"),
        "chat_template": template,
        "vllm": {
            "version": vllm.get("version"),
            "adapter": vllm.get("adapter"),
            "path": (vllm.get("extraction_path") or {}).get("chosen"),
        },
    }
    if marked(report):  # a rehearsal's (random weights): never a real run's identity
        kept["rehearsal"] = True
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def shard_expectation(preflight_path: Path) -> dict:
    """What every hidden-state shard of a run must match (ShardReader's `expect`: the fields of
    eyrie.formats.hidden's CHECKED_FIELDS), from the run's preflight report: training and the
    benchmarks that read its shards ask the same."""
    report = read_report(preflight_path)
    target = report.get("target") or {}
    expect = {
        "target_fingerprint": target.get("fingerprint"),
        "tokenizer_hash": target.get("tokenizer_hash"),
        "aux_layer_ids": report.get("aux_layer_ids"),
        "final_layer_id": report.get("final_layer_id"),
        "hidden_size": target.get("hidden_size"),
    }
    names = {
        "target_fingerprint": "target.fingerprint",
        "tokenizer_hash": "target.tokenizer_hash",
        "hidden_size": "target.hidden_size",
    }
    for key, value in expect.items():
        if value is None:
            raise EyrieError(
                f"{preflight_path}: key {names.get(key, key)} missing; rerun eyrie preflight"
            )
    return expect
