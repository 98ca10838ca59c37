"""Snakemake as the workflow tests run it: the repository's Snakefile on a working directory and
its config files, the tiny config (.test/config.yaml) written with overrides, the job table
a run or dry run prints, and the finished tiny run (built once per session by tests/conftest.py's
`tiny_run`) with the copy a test that changes it works on."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support import REPO
from tests.support.stages import demo_conversations

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


def build_tiny_run(workdir: Path) -> Path:
    """The tiny config run to completion in `workdir`, on the demo conversations it names."""
    write_config(workdir)
    convs = demo_conversations(workdir / "convs.jsonl")
    assert convs.returncode == 0, convs.stderr
    snakemake(workdir)
    return workdir


def copy_run(run: Path, dest: Path) -> Path:
    """A finished run's working directory copied to `dest` as a run of its own: .snakemake/
    (Snakemake's records) included, every file's mtime kept (copy2) and links kept as links
    (`draft` names its version relatively), so that the copy plans nothing either. Nothing that
    Snakemake compares holds the run's absolute path (params, store.path and cache.path are
    relative to the working directory); reports that name the target's absolute path
    (preflight.json, train.json, the draft's verifier) say where it was, and the copy's jobs get
    their target from their own arguments. An engine's socket is left out: between runs only its
    placeholder is there, and a live socket cannot be copied."""
    shutil.copytree(run, dest, symlinks=True, ignore=shutil.ignore_patterns("*.sock"))
    return dest
