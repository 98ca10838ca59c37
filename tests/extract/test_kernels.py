"""`eyrie compile-kernels` (eyrie.extract.kernels) and the cache lock engines take
(eyrie.vllm.fatbin): which vLLM kernel unit a target's engine compiles from PTX on an H100, read
from the published Kimi-K2.5 quantization_config and the installed vLLM 0.22's own libraries and
ScalarType ids; a target without Marlin kernels, or a machine without a GPU, compiles nothing and
says why; an engine waits while the lock is held, and starts anyway once its wait runs out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from unittest import mock

import pytest

from eyrie.extract.kernels import is_moe, marlin_types
from eyrie.preflight.vllm_env import run_gatherer
from eyrie.vllm import fatbin
from tests.support import REPO
from tests.support.vllm_helpers import KIMI_K25, LLAMA, VLLM_PYTHON, need_vllm

KIMI_INT4 = json.loads((REPO / "tests" / "configs" / "kimi-k2.5-quantization.json").read_text())
KIMI_K25_INT4 = {
    **KIMI_K25,
    "text_config": {**KIMI_K25["text_config"], "quantization_config": KIMI_INT4},
}


def test_kimi_k25_runs_the_bf16_uint4b8_moe_kernels():
    assert marlin_types(KIMI_K25_INT4) == ("bfloat16", "uint4b8") and is_moe(KIMI_K25_INT4)


def test_stand_in_gptq_and_awq_configs_name_their_weight_types():
    # stand-ins: quantization_config as AutoGPTQ (sym) and AutoAWQ (zero points) write them
    gptq = {
        **LLAMA,
        "torch_dtype": "float16",
        "quantization_config": {"quant_method": "gptq", "bits": 4, "sym": True},
    }
    awq = {
        **LLAMA,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "awq", "bits": 4},
    }
    assert marlin_types(gptq) == ("float16", "uint4b8") and not is_moe(gptq)
    assert marlin_types(awq) == ("bfloat16", "uint4")


def test_targets_without_marlin_kernels_say_why():
    assert marlin_types(LLAMA) == "the target is not quantized"
    fp8 = {**LLAMA, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert marlin_types(fp8) == "quantization_config: quant_method 'fp8'"
    groups = {
        "group_0": {**KIMI_INT4["config_groups"]["group_0"], "input_activations": {"num_bits": 8}}
    }
    w4a8 = {**LLAMA, "quantization_config": {**KIMI_INT4, "config_groups": groups}}
    assert marlin_types(w4a8) == "quantization_config: not a weight-only scheme"


SCALAR_IDS = """
import json
from eyrie.extract.kernels import scalar_types
from eyrie.vllm.fatbin import vllm_root
names = ("bfloat16", "float16", "uint4b8", "uint4", "uint8b128")
alone = {n: getattr(scalar_types(vllm_root()), n).id for n in names}
from vllm.scalar_type import scalar_types as imported
print(json.dumps([alone, {n: getattr(imported, n).id for n in names}]))
"""


@need_vllm
@pytest.mark.vllm_env
@pytest.mark.slow  # imports vLLM (6 s here)
def test_the_scalar_type_ids_read_without_importing_vllm_are_vllms_own():
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", SCALAR_IDS], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    alone, imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert alone == imported and len(set(alone.values())) == 5


CHOOSE = """
import json, sys
from pathlib import Path
from eyrie.extract.kernels import chosen_units
from eyrie.vllm.fatbin import vllm_root
units, why = chosen_units(vllm_root(), 90, json.loads(sys.argv[1]))
print(json.dumps([why, [[Path(u["lib"]).name, u["label"]] for u in units]]))
"""


@need_vllm
@pytest.mark.vllm_env
@pytest.mark.slow  # reads every PTX-only unit's PTX, three times
def test_on_an_h100_the_kimi_target_compiles_one_moe_unit_and_a_dense_fp16_gptq_target_one():
    # stand-ins: a dense GPTQ target in fp16 and in bf16 (vLLM builds bf16 dense Marlin for sm_90)
    gptq = {"quant_method": "gptq", "bits": 4, "sym": True}
    dense = [
        {**LLAMA, "torch_dtype": dtype, "quantization_config": gptq}
        for dtype in ("float16", "bfloat16")
    ]
    found = []
    for config in (KIMI_K25_INT4, *dense):
        proc = subprocess.run(
            [str(VLLM_PYTHON), "-c", CHOOSE, json.dumps(config)],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        found.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert found == [
        [
            "MoE Marlin kernels for bfloat16 x uint4b8",
            [["_moe_C.abi3.so", "marlin_moe_wna16::Marlin<bfloat16, uint4b8>"]],
        ],
        [
            "dense Marlin kernels for float16 x uint4b8",
            [["_C.abi3.so", "marlin::Marlin<float16, uint4b8>"]],
        ],
        ["dense Marlin kernels for bfloat16 x uint4b8", []],
    ]


def compile_stage(target, out, env=None) -> dict:
    """`eyrie compile-kernels` in the vLLM environment, as the rule runs it; its kernels.json."""
    cmd = [str(VLLM_PYTHON), "-m", "eyrie.cli", "compile-kernels", "--target", str(target)]
    cmd += ["--out", str(out), "--python", str(VLLM_PYTHON)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@need_vllm
@pytest.mark.vllm_env
@pytest.mark.slow  # imports vLLM in two processes (18 s here)
def test_without_a_gpu_the_stage_compiles_nothing_and_says_why(tmp_path):
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver")
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K25_INT4))
    facts = tmp_path / "facts"
    env = dict(os.environ, EYRIE_VLLM_FACTS_CACHE=str(facts))
    done = compile_stage(tmp_path, tmp_path / "kernels.json", env)
    assert {k: done[k] for k in ("compiled", "why")} == {
        "compiled": [],
        "why": "nothing to compile: no GPU here",
    }
    assert done["facts"]["read"] and "kept for preflight" in done["facts"]["why"]
    # preflight's probe finds them: the same entry, not a second one
    kept = sorted(facts.glob("*.json"))
    with mock.patch.dict(os.environ, {"EYRIE_VLLM_FACTS_CACHE": str(facts)}):
        got = run_gatherer(VLLM_PYTHON, [KIMI_K25_INT4])[0]
    assert sorted(facts.glob("*.json")) == kept and len(kept) == 1
    assert got == json.loads(kept[0].read_text())["facts"]


HOLD = """
import sys, time
from eyrie.vllm.fatbin import compilation_lock
with compilation_lock(exclusive=True) as held:
    print(held, flush=True)
    time.sleep(float(sys.argv[1]))
"""


def test_an_engine_waits_while_the_lock_is_held_and_not_past_its_wait(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_CACHE_PATH", str(tmp_path / "cuda"))
    monkeypatch.delenv("CUDA_CACHE_DISABLE", raising=False)
    for hold_s, wait_s, at_least, at_most in ((1.5, 30, 1.0, 29), (30, 1.0, 0.9, 20)):
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(hold_s)],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
            cwd=REPO,
        )
        try:
            assert holder.stdout.readline().strip() == "True"  # the lock is held from here on
            start = time.monotonic()
            fatbin.wait_for_compilation(wait_s)
            waited = time.monotonic() - start
        finally:
            holder.kill()
            holder.wait()
        assert at_least <= waited <= at_most, (hold_s, wait_s, waited)
    assert fatbin.wait_for_compilation(1.0) < 0.9  # nobody holds it: no wait


@pytest.mark.gpu
def test_on_a_gpu_the_kimi_unit_compiles_once_then_loads_from_the_cache(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K25_INT4))
    env = dict(os.environ, CUDA_CACHE_PATH=str(tmp_path / "cuda"))
    runs = [compile_stage(tmp_path, tmp_path / f"kernels{n}.json", env) for n in (1, 2)]
    first, again = (r["compiled"] for r in runs)
    assert [u["kernels"] for u in first] == ["marlin_moe_wna16::Marlin<bfloat16, uint4b8>"]
    assert not first[0]["from_cache"] and again[0]["from_cache"]
