"""eyrie.vllm.quantization against the REAL installed vLLMs: the packages a target's quantization
method imports on a GPU, read on a CPU from vLLM's own code, and preflight's problem when the vLLM
environment cannot import one. The missing package is a real import failure (a finder on
PYTHONPATH that refuses `humming`), the real environment untouched; one subprocess per
environment and case (each imports vLLM, ~12 s).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from eyrie.arch.target import inspect_target
from eyrie.preflight.vllm_checks import VllmTarget, vllm_checks
from tests.support import TESTS
from tests.support.vllm_helpers import (
    KIMI_K25,
    LLAMA,
    VLLM_ENVS,
    VLLM_PYTHON,
    need_vllm,
    vllm_env,
    vllm_settings,
    write_target,
)

# Kimi-K2.5's quantization_config (config.json's text_config): compressed-tensors, int4 experts
KIMI_INT4 = json.loads((TESTS / "configs" / "kimi-k2.5-quantization.json").read_text())
KIMI_K25_INT4 = {
    **KIMI_K25,
    "text_config": {**KIMI_K25["text_config"], "quantization_config": KIMI_INT4},
}
FP8 = {
    **LLAMA,
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}
CONFIGS = {"kimi_int4": KIMI_K25_INT4, "fp8": FP8, "unquantized": LLAMA}

ASK = (
    "import json, sys\n"
    "from eyrie.vllm.quantization import required_packages\n"
    "for path in sys.argv[1:]:\n"
    "    print('PACKAGES ' + json.dumps(required_packages(json.load(open(path)))), flush=True)\n"
)

# sitecustomize for the stand-in environment: `import humming` fails as if it were not installed
BLOCK_HUMMING = '''import sys


class RefuseHumming:
    """A finder that refuses the humming package, like an environment without it."""

    def find_spec(self, name, path=None, target=None):
        if name == "humming" or name.startswith("humming."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, RefuseHumming())
'''

# what vLLM does with `humming` per version: 0.22's get_quantization_config imports
# quantization/humming.py, which imports it under `if current_platform.is_cuda():`; 0.26, 0.33
# and 0.34 reach it through a lazy facade (vllm.utils.humming) after has_humming()
HUMMING = {
    "0.22.0": {"optional": False, "when": "at module import on a CUDA GPU"},
    "0.26.0": {"optional": True},
    "0.33.0": {"optional": True},
    "0.34.0": {"optional": True},
}


@functools.cache
def required(python: Path) -> dict:
    """required_packages for every CONFIGS entry in the environment of `python` (one process)."""
    with tempfile.TemporaryDirectory(prefix="eyrie-quant-") as tmp:
        paths = []
        for name, config in CONFIGS.items():
            paths.append(Path(tmp) / f"{name}.json")
            paths[-1].write_text(json.dumps(config))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run(
            [str(python), "-c", ASK, *map(str, paths)],
            cwd=tmp,
            env={**env, "VLLM_LOGGING_LEVEL": "ERROR"},
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("PACKAGES ")]
    return dict(zip(CONFIGS, map(json.loads, lines), strict=True))


@pytest.mark.slow
@need_vllm
def test_kimi_int4_fp8_and_unquantized_on_the_default_vllm():
    got = required(VLLM_PYTHON)
    kimi = got["kimi_int4"]
    assert kimi["quant_method"] == "compressed-tensors"
    assert kimi["where"] == "text_config.quantization_config"
    assert kimi["python"] == str(VLLM_PYTHON)
    assert "CompressedTensorsConfig" in kimi["how"]
    humming = kimi["modules"]["humming"]
    assert humming["importable"] is True and humming["optional"] is False
    assert humming["package"] == "humming-kernels"
    assert humming["required"] == "==0.1.2"  # vLLM 0.22.0's Requires-Dist
    assert humming["requirement"] == "humming-kernels[cu13]==0.1.2"
    assert humming["when"] == "at module import on a CUDA GPU"
    assert humming["imported_by"] == [
        "get_quantization_config",
        "vllm.model_executor.layers.quantization.humming",
    ]
    ct = kimi["modules"]["compressed_tensors"]
    assert ct["importable"] and not ct["optional"] and ct["package"] == "compressed-tensors"
    # whatever the method, the required ones import here; the optional may not (aiter, ...)
    for result in (kimi, got["fp8"]):
        assert [
            n for n, m in result["modules"].items() if not m["optional"] and not m["importable"]
        ] == []
        assert any(not m["importable"] for m in result["modules"].values())
    fp8 = got["fp8"]
    assert (fp8["quant_method"], fp8["where"]) == ("fp8", "quantization_config")
    assert "Fp8Config" in fp8["how"]
    # 0.22's get_quantization_config imports every method's module: fp8 needs humming too
    assert fp8["modules"]["humming"]["optional"] is False
    assert got["unquantized"] is None


@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(VLLM_ENVS))
def test_humming_per_vllm_version(version):
    got = required(vllm_env(version))["kimi_int4"]
    humming = got["modules"]["humming"]
    assert {k: humming[k] for k in HUMMING[version]} == HUMMING[version]
    assert humming["importable"] and humming["package"] == "humming-kernels"
    assert humming["requirement"].startswith("humming-kernels")  # each pins its own version


@pytest.mark.slow
@need_vllm
def test_vllm_environment_without_humming_is_a_problem_with_the_fix(tmp_path):
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(BLOCK_HUMMING)
    # the stand-in vLLM environment: the real one, with `humming` refused at import
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={block} exec {VLLM_PYTHON} "$@"\n')
    python.chmod(0o755)
    refused = subprocess.run(
        [str(python), "-c", "import humming"], capture_output=True, text=True, timeout=60
    )
    assert "No module named 'humming'" in refused.stderr
    folder = write_target(tmp_path / "target", KIMI_K25_INT4, weights_gib=595)
    info = inspect_target(folder)
    settings = vllm_settings(python=str(python), tensor_parallel_size=8, gpu_memory_gib=141)
    got = vllm_checks(VllmTarget(folder, info, [2, 30, 57], 61), settings)
    hits = [p for p in got["problems"] if "'humming'" in p]
    assert hits == [
        "config.json: text_config.quantization_config.quant_method='compressed-tensors': "
        "vLLM 0.22.0 needs the module 'humming' (pip package humming-kernels), which the vLLM "
        f"environment at {VLLM_PYTHON} cannot import "
        "(vllm.model_executor.layers.quantization.humming imports it at module import on a "
        "CUDA GPU); install it there (pip install 'humming-kernels[cu13]==0.1.2') or re-run "
        "bash scripts/setup-vllm.sh"
    ]
    packages = got["report"]["quantization"]["packages"]
    assert packages["modules"]["humming"]["importable"] is False
