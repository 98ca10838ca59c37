"""vLLM extraction on a GPU against the Hugging Face backend (marked `gpu`: run with `-m gpu` on a
CUDA machine that has the vLLM environment; docs/vllm.md has the figures of the last run).

Each step of tests/support/vllm_gpu_check.py runs in its own process of the vLLM python (one
engine per process frees GPU memory reliably)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.vllm_helpers import need_cuda

VLLM_PYTHON = os.environ.get("EYRIE_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))
CHECK = str(REPO / "tests" / "support" / "vllm_gpu_check.py")

pytestmark = pytest.mark.gpu
KINDS = ("llama", "deepseek_v3", "kimi_k25")


def kinds() -> list[str]:
    """EYRIE_GPU_KINDS=llama,...: only those families (a device call's time limit); the others'
    tests skip. Default: every family."""
    return os.environ.get("EYRIE_GPU_KINDS", ",".join(KINDS)).split(",")


def step(*args: str, timeout: int = 600) -> str:
    proc = subprocess.run(
        [VLLM_PYTHON, CHECK, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    if os.environ.get("EYRIE_GPU_LOGS"):  # where to keep each step's log (the runner vLLM chose)
        logs = Path(os.environ["EYRIE_GPU_LOGS"])
        logs.mkdir(parents=True, exist_ok=True)
        (logs / ("-".join(args[:1] + args[2:]) + ".log")).write_text(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    need_cuda(VLLM_PYTHON)
    root = tmp_path_factory.mktemp("vllm_gpu")
    step("build", str(root))
    for kind in kinds():
        if kind != "kimi_k25":  # the wrapper's reference is its text model's (deepseek_v3)
            step("hf", str(root), kind)
        for path in ("native", "capture"):
            step("vllm", str(root), kind, path)
    table = json.loads(step("compare", str(root)))
    if os.environ.get("EYRIE_GPU_TABLE"):  # where to keep the table (docs/vllm.md's figures)
        Path(os.environ["EYRIE_GPU_TABLE"]).write_text(json.dumps(table, indent=1))
    return table


@pytest.mark.parametrize("path", ["native", "capture"])
def test_llama_both_paths_match_hugging_face(table, path):
    row = checked(table, f"llama/{path}")
    assert row["samples"] == 12 and row["min_cos"] >= 0.999, row


@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_k25"])
def test_deepseek_native_where_vllm_returns_the_final_state(table, kind):
    # vLLM 0.22 never returns id N for the DeepSeek family (native refused); 0.26 on does
    row = checked(table, f"{kind}/native")
    if table["vllm_version"] == "0.22.0":
        assert "refused" in row and "never returned" in row["refused"], row
    else:
        assert_matches_except_routing_ties(row)


@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_k25"])
def test_deepseek_capture_matches_except_at_routing_ties(table, kind):
    assert_matches_except_routing_ties(checked(table, f"{kind}/capture"))


def checked(table: dict, key: str) -> dict:
    """The table's row for `key`; a skip where EYRIE_GPU_KINDS left its family out."""
    if key not in table and key.split("/")[0] not in kinds():
        pytest.skip(f"{key}: not in EYRIE_GPU_KINDS")
    return table[key]


def assert_matches_except_routing_ties(row):
    assert row.get("samples") == 12, row
    assert row["per_id"]["1"]["min_cos"] >= 0.999  # before any MoE layer: every token agrees
    for k, r in row["per_id"].items():
        assert r["tokens_below_0.999"] <= 0.05 * row["tokens"], (k, r)
        # the tokens that differ are the ones whose expert choice is a near-tie
        for margin in r.get("routing_margin_of_tokens_below", []):
            assert margin < r["median_routing_margin"], (k, r)
