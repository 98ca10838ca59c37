"""Smoke test of benchmarks/read_path.py: a few MB, warm cache only, in a subprocess.

Checks the script runs end to end (builds both layouts, checks the readers agree, times them)
and writes JSON with every cell and positive ratios; the figures themselves are in BENCHMARKS.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_read_path_smoke(tmp_path):
    out = tmp_path / "read_path.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "read_path.py"), "--gb", "0.004",
           "--hidden", "64", "--min-tokens", "16", "--max-tokens", "64", "--shards", "2",
           "--repeats", "1", "--no-cold", "--dir", str(tmp_path / "data"), "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "eyrie/peer" in run.stdout
    r = json.loads(out.read_text())
    assert set(r["cells"]) == {"warm"}
    cell = r["cells"]["warm"]
    for k in ("eyrie", "eyrie_checked", "eyrie_h5py", "eyrie_fp8", "peer", "verify"):
        assert cell[k]["GB_per_s"] > 0 and cell[k]["samples_per_s"] > 0, k
        if k != "peer":
            assert cell[f"ratio_{k}_over_peer"] > 0 and len(cell[f"ratio_{k}_over_peer_per_pass"]) == 1
    assert r["per_read_best_warm"]["ratio_eyrie_over_peer"] > 0
    assert r["data"]["shards"] == 2 and r["data"]["samples"] >= 2
    assert r["data"]["hidden_bytes"] == r["data"]["tokens"] * 4 * 64 * 2
    assert not (tmp_path / "data").exists()  # removed without --keep
