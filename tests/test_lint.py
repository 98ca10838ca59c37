"""The lint gates, run by the test suite (and by scripts/lint.sh): ruff check and ruff format
over the repository (settings in pyproject.toml), snakefmt over the Snakefile and rules/,
`snakemake --lint`, and a dry run of the tiny config (.test/config.yaml). Each failure carries
the tool's own output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / ".test" / "config.yaml"


def tool(*cmd: str, cwd: Path = REPO, timeout: int = 300) -> str:
    """Run `python -m <tool> ...` in this environment; fail with the tool's output unless it
    exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", *cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{out[-20000:]}", pytrace=False)
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """An empty working directory for the tiny config, with the conversations file it names."""
    work = tmp_path_factory.mktemp("tiny")
    (work / "convs.jsonl").touch()
    return work


def snakemake(workdir: Path, *args: str) -> str:
    return tool(
        "snakemake",
        "-s",
        str(REPO / "Snakefile"),
        "-d",
        str(workdir),
        "--configfile",
        str(TINY),
        *args,
        cwd=workdir,
    )


def test_ruff_check():
    tool("ruff", "check", "--no-cache", "--output-format", "concise", ".")


def test_ruff_format():
    tool("ruff", "format", "--check", "--no-cache", ".")


def test_snakefmt():
    tool("snakefmt", "--check", "--compact-diff", "Snakefile", "rules/")


def test_snakemake_lint(workdir):
    snakemake(workdir, "--lint")


def test_tiny_config_dry_run(workdir):
    out = snakemake(workdir, "-n")
    assert "Job stats:" in out and "extract_hidden_states" in out, out[-6000:]
