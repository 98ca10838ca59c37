"""The lint gates, run by the test suite (and by scripts/lint.sh): ruff check and ruff format
over the repository (settings in pyproject.toml), snakefmt over the Snakefile and rules/,
`snakemake --lint` (clean but for the lints KEPT_LINTS names, each with its reason), and a dry
run of the tiny config (.test/config.yaml). Each failure carries the tool's own output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.workflow import snakemake_args

TINY = REPO / ".test" / "config.yaml"


def tool(*cmd: str, cwd: Path = REPO, timeout: int = 300, ok: tuple[int, ...] = (0,)) -> str:
    """Run `python -m <tool> ...` in this environment; fail with the tool's output unless its
    exit status is one of `ok`."""
    proc = subprocess.run(
        [sys.executable, "-m", *cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    out = proc.stdout + proc.stderr
    if proc.returncode not in ok:
        pytest.fail(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{out[-20000:]}", pytrace=False)
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """An empty working directory for the tiny config, with the conversations file it names."""
    work = tmp_path_factory.mktemp("tiny")
    (work / "convs.jsonl").touch()
    return work


def snakemake(workdir: Path, *args: str, ok: tuple[int, ...] = (0,)) -> str:
    return tool("snakemake", *snakemake_args(workdir, TINY), *args, cwd=workdir, ok=ok)


def test_ruff_check():
    tool("ruff", "check", "--no-cache", "--output-format", "concise", ".")


def test_ruff_format():
    tool("ruff", "format", "--check", "--no-cache", ".")


def test_snakefmt():
    tool("snakefmt", "--check", "--compact-diff", "Snakefile", "rules/")


# The lints this workflow keeps on purpose, each for a reason; any other lint fails the gate, and
# so does an entry here that no longer fires (the list stays true).
SOFTWARE = "Specify a conda environment or container for each rule."
OUTSIDE = "Shell command directly uses variable {} from outside of the rule"
KEPT_LINTS = {
    # The software is two pip environments (envs/*.txt via scripts/setup*.sh): speculators must
    # be installed without its dependencies and vLLM pins its own torch, which neither a conda
    # file nor a container of ours expresses; the rules call the environment's own `eyrie`.
    **{
        (rule, SOFTWARE): "pip environments"
        for rule in (
            "build_demo_conversations",
            "build_demo_target",
            "regenerate_responses",
            "preflight_regenerate",
            "tokenize_conversations",
            "build_vocab_map",
            "preflight",
            "extract_engine",
            "extract_hidden_states",
            "compile_kernels",
            "train_draft",
            "export_draft",
            "tokenize_eval_prompts",
            "evaluate_draft",
            "evaluate_vllm",
            "train_also",
            "export_also",
            "evaluate_also",
            "compare_drafts",
        )
    },
    # Read at run time but not compared: a change of the vLLM environment or GPU memory must
    # rerun nothing (params are compared by the rerun trigger).
    ("preflight", OUTSIDE.format("PREFLIGHT_RUNTIME")): "runtime only",
    ("preflight_regenerate", OUTSIDE.format("PREFLIGHT_REGENERATE_RUNTIME")): "runtime only",
    ("extract_hidden_states", OUTSIDE.format("config")): "engine_wait_s: runtime only",
    (
        "evaluate_vllm",
        OUTSIDE.format("EVALUATE_VLLM_RUNTIME"),
    ): "gpu_memory_utilization: runtime only",
    # The engine is a service: any params of its own would plan it without its shard jobs
    # (docs/extraction.md), so its command comes from globals and the shard jobs carry the triggers.
    **{
        ("extract_engine", OUTSIDE.format(v)): "service without params"
        for v in (
            "ENGINE_COMMAND",
            "TARGET_ARG",
            "EXTRACT_SETTINGS",
        )
    },
}


def lints(text: str) -> set[tuple[str, str]]:
    """(rule, lint title) of each lint in `snakemake --lint`'s text output."""
    found, rule = set(), None
    for line in text.splitlines():
        if line.startswith("Lints for rule "):
            rule = line[len("Lints for rule ") :].split(" ", 1)[0]
        elif line.startswith("    * ") and rule:
            found.add((rule, line[len("    * ") :].rstrip(":").rstrip()))
        elif line.startswith("Lints for ") and not line.startswith("Lints for rule "):
            rule = line  # a snakefile-level lint: never kept
    return found


def test_snakemake_lint(workdir):
    out = snakemake(workdir, "--lint", ok=(0, 1))  # 1: lints were found
    found = lints(out)
    unexpected = sorted(found - set(KEPT_LINTS))
    stale = sorted(set(KEPT_LINTS) - found)
    assert not unexpected, f"new lints: {unexpected}\n{out[-6000:]}"
    # (also what an exit 1 without any lint, a failed parse, runs into)
    assert not stale, (
        f"kept lints that no longer fire (drop them from KEPT_LINTS): {stale}\n" + out[-6000:]
    )


def test_tiny_config_dry_run(workdir):
    out = snakemake(workdir, "-n")
    assert "Job stats:" in out and "extract_hidden_states" in out, out[-6000:]
