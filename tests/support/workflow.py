"""Snakemake as the workflow tests run it: the repository's Snakefile on a working directory and
its config files, the tiny config (.test/config.yaml) written with overrides, and the job table
a run or dry run prints."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support import REPO

SNAKEFILE = REPO / "Snakefile"
# The tiny config; its data.conversations, convs.jsonl, is written by each test's run.
TINY = yaml.safe_load((REPO / ".test" / "config.yaml").read_text())


def write_config(workdir: Path, **overrides) -> Path:
    """The tiny config as workdir/config.yaml; `section__key=value` overrides one key."""
    cfg = json.loads(json.dumps(TINY))
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        cfg.setdefault(section, {})[key] = value
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def snakemake_args(workdir: Path, *configfiles: Path) -> list[str]:
    """`-s Snakefile -d WORKDIR --configfile FILE...` (default WORKDIR/config.yaml). What follows
    must start with an option: --configfile takes every word up to the next one."""
    files = configfiles or (workdir / "config.yaml",)
    return ["-s", str(SNAKEFILE), "-d", str(workdir), "--configfile", *map(str, files)]


def run_snakemake(
    workdir: Path,
    *args: str,
    configfiles: tuple[Path, ...] = (),
    python: Path | None = None,
    **run,
) -> subprocess.CompletedProcess:
    """`python -m snakemake` (this environment's, or `python`'s) on `workdir` and its config
    files, failing or not (the test reads its output); `run`: subprocess.run's keywords
    (timeout, cwd)."""
    cmd = [str(python or sys.executable), "-m", "snakemake"]
    cmd += [*snakemake_args(workdir, *configfiles), *args]
    return subprocess.run(cmd, capture_output=True, text=True, **run)


def snakemake(workdir: Path, *args: str, timeout: int = 600, python: Path | None = None) -> str:
    """The workflow on workdir/config.yaml with 2 cores; its output, or an AssertionError with
    that output and the tails of its logs."""
    proc = run_snakemake(workdir, "--cores", "2", *args, python=python, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in workdir.glob("logs/**/*.log"))
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{out[-6000:]}\n{logs}")
    return out


def job_table(out: str) -> dict[str, int]:
    """Rule -> job count from Snakemake's "Job stats" table ({} when nothing is to be done)."""
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:", 1)[1].split("total", 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M)}


def planned(workdir: Path, *targets: str) -> dict[str, int]:
    """Rule -> job count that a dry run plans ({} when nothing is to be done)."""
    return job_table(snakemake(workdir, "-n", *targets))
