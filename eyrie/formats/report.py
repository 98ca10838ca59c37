"""eyrie.formats.report: TODO docstring."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eyrie.errors import PreflightError

log = logging.getLogger(__name__)


def read_report(path: str | Path, fingerprint: str | None = None) -> dict:
    """A preflight report that passed; with `fingerprint`, one made for the target as it is now.

    The one reader of this stage's output, for every stage that is gated on it.
    """
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
