"""The preflight report's reader: preflight.json, for every stage gated on it.

`read_report` returns the report only when it passed (`ok` is true) and, given the target's
fingerprint, only when it was made for the target as it is now. The file: docs/contracts.md#files.
"""

from __future__ import annotations

import json
from pathlib import Path

from eyrie.errors import PreflightError


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
