"""Workflow overhead: wall time of `snakemake -n` (a dry run that plans everything) on an empty
working directory, for configs with N tokenized/hidden-state shards (issue 5, item 4: goal
<= 15 s at N = 10,000 on 2 cores).

    .venv/bin/python benchmarks/workflow_overhead.py --shards 500 1000 2000 [--timeout 300]

Prints a table and writes benchmarks/results/workflow_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def dry_run(shards: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="eyrie-overhead-") as work:
        config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
        config["data"]["num_shards"] = shards
        path = Path(work) / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", work,
               "--configfile", str(path), "-n", "--quiet", "rules"]
        start = time.perf_counter()
        try:
            # SIGKILL: a planning Snakemake may not stop on SIGTERM
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"shards": shards, "seconds": None, "timed_out_after_s": timeout}
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"snakemake -n failed for {shards} shards:\n{proc.stderr[-3000:]}")
        jobs = next((int(line.split()[-1]) for line in proc.stdout.splitlines()
                     if line.startswith("total")), None)
        return {"shards": shards, "seconds": round(seconds, 2), "jobs": jobs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[500, 1000, 2000])
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "workflow_overhead.json"))
    args = parser.parse_args()
    rows = [dry_run(n, args.timeout) for n in args.shards]
    print(f"{'shards':>8} {'jobs':>7} {'snakemake -n (s)':>17}")
    for r in rows:
        t = f"{r['seconds']:.1f}" if r["seconds"] is not None else f"> {r['timed_out_after_s']:.0f}"
        print(f"{r['shards']:>8} {str(r.get('jobs', '-')):>7} {t:>17}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "date": date.today().isoformat(), "machine": f"{platform.node()} {os.cpu_count()} cores",
        "command": " ".join(["benchmarks/workflow_overhead.py", *sys.argv[1:]]), "goal": "<= 15 s at 10000 shards",
        "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
