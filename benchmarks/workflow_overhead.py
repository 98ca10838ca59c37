"""Workflow overhead: wall and CPU time of `snakemake -n` for configs with N tokenized/hidden-state
shards (goal: at most 15 s at N = 10,000 on 2 cores), in two states:

- plan all: an empty working directory, so the dry run plans every job (N shard jobs, N/16
  engines and the rest);
- complete: every output present and recorded (created, then `snakemake --touch -F`), so the
  dry run must plan 0 jobs.

The peer, run the same way in the same run: a one-rule Snakefile with as many trivial jobs as the
plan-all DAG, i.e. what Snakemake itself needs per job before any of this workflow's rules count.

    .venv/bin/python benchmarks/workflow_overhead.py --shards 1000 2000 4000 10000 \
        [--repeat 2] [--no-complete]

Prints a table and writes benchmarks/results/workflow_overhead.json. Times are the best of
--repeat runs (the machine may be shared; CPU time is user + system of the snakemake process).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
PEER = """\
rule all:
    input: expand("out/{{i}}.txt", i=range({n}))

rule one:
    input: "src.txt"
    output: "out/{{i}}.txt"
    shell: "cp {{input}} {{output}}"
"""


def timed(
    cmd: list[str], timeout: float
) -> tuple[subprocess.CompletedProcess | None, float, float]:
    """(process or None on timeout, wall seconds, CPU seconds of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    try:
        # SIGKILL on timeout: a planning Snakemake may not stop on SIGTERM
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, timeout, float("nan")
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc, wall, cpu


def planned_jobs(out: str) -> int | None:
    """The `total` of Snakemake's job table; 0 for "Nothing to be done"."""
    if "Nothing to be done" in out:
        return 0
    return next(
        (int(line.split()[-1]) for line in out.splitlines() if line.startswith("total")), None
    )


def best_dry_run(cmd: list[str], repeat: int, timeout: float, what: str) -> dict:
    runs = []
    for _ in range(repeat):
        proc, wall, cpu = timed(cmd, timeout)
        if proc is None:
            return {"seconds": None, "timed_out_after_s": timeout}
        if proc.returncode != 0:
            raise SystemExit(f"{what}: snakemake -n failed:\n{proc.stderr[-3000:]}")
        runs.append((wall, cpu, planned_jobs(proc.stdout + proc.stderr)))
    wall, cpu, jobs = min(runs)
    return {
        "seconds": round(wall, 2),
        "cpu_seconds": round(cpu, 2),
        "jobs": jobs,
        "all_seconds": [round(r[0], 2) for r in runs],
    }


def make_complete(work: Path, smk: list[str], timeout: float) -> None:
    """Create every output the DAG lists (`--summary`; a path without a suffix is a directory()
    output), then let `snakemake --touch -F` order their mtimes and record their metadata."""
    proc = subprocess.run([*smk, "--summary"], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"snakemake --summary failed:\n{proc.stderr[-3000:]}")
    for line in proc.stdout.splitlines()[1:]:
        path = work / line.split("\t", 1)[0]
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix:
            path.touch()
        else:
            path.mkdir(exist_ok=True)
    touch = subprocess.run(
        [*smk, "--touch", "-F", "--cores", "1", "--quiet", "all"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if touch.returncode != 0:
        raise SystemExit(f"snakemake --touch -F failed:\n{touch.stderr[-3000:]}")


def measure(shards: int, repeat: int, timeout: float, complete: bool) -> dict:
    row: dict = {"shards": shards}
    with tempfile.TemporaryDirectory(prefix="eyrie-overhead-") as tmp:
        work = Path(tmp)
        config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
        config["data"]["num_shards"] = shards
        (work / "config.yaml").write_text(yaml.safe_dump(config))
        smk = [
            *SNAKEMAKE,
            "-s",
            str(REPO / "Snakefile"),
            "-d",
            str(work),
            "--configfile",
            str(work / "config.yaml"),
        ]
        row["plan_all"] = best_dry_run(
            [*smk, "-n", "--quiet", "rules"], repeat, timeout, f"{shards} shards, empty directory"
        )
        jobs = row["plan_all"].get("jobs")
        if jobs:
            peer = work / "peer"
            peer.mkdir()
            (peer / "Snakefile").write_text(PEER.format(n=jobs - 1))  # + rule all = jobs
            (peer / "src.txt").touch()
            row["peer"] = best_dry_run(
                [
                    *SNAKEMAKE,
                    "-s",
                    str(peer / "Snakefile"),
                    "-d",
                    str(peer),
                    "-n",
                    "--quiet",
                    "rules",
                ],
                repeat,
                timeout,
                f"peer with {jobs} jobs",
            )
        if complete and row["plan_all"]["seconds"] is not None:
            make_complete(work, smk, timeout=max(timeout, 1800))
            row["complete"] = best_dry_run(
                [*smk, "-n"], repeat, timeout, f"{shards} shards, complete workflow"
            )
            if row["complete"].get("jobs") not in (0, None):
                raise SystemExit(
                    f"{shards} shards: an unchanged complete workflow planned "
                    f"{row['complete']['jobs']} jobs (want 0)"
                )
    return row


def slurm_probe_s(timeout: float = 15.0) -> float | None:
    """Seconds of `scontrol show config`, which the SLURM executor plugin runs (timeout 10 s) when
    Snakemake loads its plugins, i.e. in every cell of this benchmark; None without scontrol.
    With SLURM's client tools installed and no controller answering, every call waits for it
    (BENCHMARKS.md, "Workflow overhead")."""
    if shutil.which("scontrol") is None:
        return None
    start = time.perf_counter()
    try:
        subprocess.run(["scontrol", "show", "config"], capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    return round(time.perf_counter() - start, 3)


def cell(result: dict | None, key: str = "seconds") -> str:
    if not result:
        return "-"
    if result.get("seconds") is None:
        return f"> {result['timed_out_after_s']:.0f}"
    return f"{result[key]:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[1000, 2000, 4000, 10000])
    parser.add_argument(
        "--repeat", type=int, default=2, help="runs per measurement; the best counts"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per dry run")
    parser.add_argument(
        "--no-complete",
        dest="complete",
        action="store_false",
        help="skip the complete-workflow state (its --touch -F takes minutes at 10,000)",
    )
    parser.add_argument(
        "--out", default=str(REPO / "benchmarks" / "results" / "workflow_overhead.json")
    )
    args = parser.parse_args()
    probe = slurm_probe_s()
    print(
        f"scontrol show config (run by the SLURM executor plugin in every cell): "
        f"{'no scontrol' if probe is None else f'{probe:.2f} s'}",
        flush=True,
    )
    rows = []
    print(
        f"{'shards':>7} {'jobs':>6} {'plan all (s)':>12} {'CPU (s)':>8} {'peer (s)':>9} "
        f"{'complete (s)':>12} {'jobs':>5}",
        flush=True,
    )
    for n in args.shards:
        r = measure(n, args.repeat, args.timeout, args.complete)
        rows.append(r)
        print(
            f"{n:>7} {str(r['plan_all'].get('jobs', '-')):>6} {cell(r['plan_all']):>12} "
            f"{cell(r['plan_all'], 'cpu_seconds'):>8} {cell(r.get('peer')):>9} "
            f"{cell(r.get('complete')):>12} {str((r.get('complete') or {}).get('jobs', '-')):>5}",
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "date": date.today().isoformat(),
                "machine": f"{platform.node()} {os.cpu_count()} cores",
                "command": " ".join(["benchmarks/workflow_overhead.py", *sys.argv[1:]]),
                "goal": "<= 15 s at 10000 shards",
                "scontrol_show_config_s": probe,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
