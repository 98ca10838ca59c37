"""eyrie.vllm.kernel_jit on the installed vLLM 0.22's own libraries: the fatbin units it reads are
the ones pyelftools finds (an independent ELF reader), and the units it compiles ahead on an sm_90
GPU are those vLLM's CMakeLists.txt builds without sm_90 code — the Marlin MoE kernels
(`MARLIN_MOE_ARCHS "8.0+PTX;12.0f"`), never FlashAttention 3 (sm_90a only). A failed compilation
is one warning and leaves the engine to compile as before. On a GPU (marked): the units compile
into the cache folder given, and a second call does nothing.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from eyrie.vllm import kernel_jit
from tests.support import REPO
from tests.support.vllm_helpers import VLLM_PYTHON, need_vllm

FIND = "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"


def vllm_root() -> Path:
    """The vllm package folder of the vLLM environment, found without importing vLLM."""
    out = subprocess.run([str(VLLM_PYTHON), "-c", FIND], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return Path(out.stdout.strip())


@need_vllm
def test_units_are_the_fatbin_sections_pyelftools_finds():
    root = vllm_root()
    libs = [root / "_moe_C.abi3.so", root / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so"]
    probe = (
        "import sys, json\nfrom elftools.elf.elffile import ELFFile\nout = []\n"
        "for p in sys.argv[1:]:\n    s = ELFFile(open(p, 'rb')).get_section_by_name('.nv_fatbin')\n"
        "    out.append([s['sh_offset'], s['sh_size']])\nprint(json.dumps(out))"
    )
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", probe, *map(str, libs)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [list(kernel_jit.fatbin_section(p)) for p in libs] == json.loads(proc.stdout)
    for lib in libs:
        found = kernel_jit.units(lib)
        assert found
        with open(lib, "rb") as f:
            for unit in found:  # each unit is a whole fatbin: its header, then its entries
                f.seek(unit["offset"])
                magic, _, head, body = struct.unpack("<IHHQ", f.read(16))
                assert magic == kernel_jit.FATBIN_MAGIC and head + body == unit["length"]
                assert unit["entries"] and all(
                    e["ptx_bytes"] >= e["bytes"] for e in unit["entries"]
                )


@need_vllm
def test_on_sm90_the_marlin_moe_units_compile_ahead_and_flash_attention_does_not():
    root = vllm_root()
    todo = kernel_jit.pending(root, 90)
    by_lib = {}
    for unit in todo:
        by_lib.setdefault(Path(unit["lib"]).relative_to(root).as_posix(), []).append(unit)
    moe = by_lib["_moe_C.abi3.so"]
    entries = {u["offset"]: u["entries"] for u in kernel_jit.units(root / "_moe_C.abi3.so")}
    for unit in moe:  # sm_80 code and PTX, nothing for sm_90: "8.0+PTX"
        kinds = {(e["kind"], e["arch"]) for e in entries[unit["offset"]]}
        assert (kernel_jit.PTX, 80) in kinds and not any(a // 10 == 9 for _, a in kinds)
    assert not [lib for lib in by_lib if lib.startswith("vllm_flash_attn/")]
    assert [u["ptx_bytes"] for u in todo] == sorted((u["ptx_bytes"] for u in todo), reverse=True)
    # an A100 runs them from their sm_80 code: nothing of the MoE library to compile there
    assert not [u for u in kernel_jit.pending(root, 80) if u["lib"].endswith("_moe_C.abi3.so")]


def test_without_a_gpu_nothing_starts_and_finish_is_silent():
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA driver")
    assert kernel_jit.start() is None and kernel_jit.finish(None) is None


def test_a_failed_compilation_is_one_warning_and_no_result(tmp_path, caplog):
    try:  # the failure here: no CUDA driver to compile with
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has a CUDA driver")
    except OSError:
        pass
    env = dict(os.environ, CUDA_CACHE_PATH=str(tmp_path / "cuda"))
    env.pop("CUDA_CACHE_DISABLE", None)
    cmd = [sys.executable, "-m", "eyrie.vllm.jit_ahead", "--site", str(tmp_path)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True, cwd=REPO
    )
    with caplog.at_level(logging.INFO, logger="eyrie.vllm.kernel_jit"):
        assert kernel_jit.finish(proc) is None
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "kernel JIT ahead failed (exit 1: OSError: libcuda.so.1" in record.message
    assert "the engine compiles them" in record.message
    assert not list((tmp_path / "cuda").glob("eyrie-kernel-jit-*.json"))


@pytest.mark.gpu
def test_on_a_gpu_the_units_compile_into_the_cache_and_a_second_call_does_nothing(tmp_path):
    root = vllm_root()
    env = dict(os.environ, CUDA_CACHE_PATH=str(tmp_path / "cuda"), CUDA_MODULE_LOADING="EAGER")
    run = [str(VLLM_PYTHON), "-m", "eyrie.vllm.jit_ahead", "--site", str(root)]
    first = subprocess.run(run, capture_output=True, text=True, env=env, cwd=REPO)
    assert first.returncode == 0, first.stderr[-3000:]
    done = json.loads(first.stdout.strip().splitlines()[-1])
    assert done["units"] == len(kernel_jit.pending(root, done["arch"])) > 0
    assert sum(f.stat().st_size for f in (tmp_path / "cuda").rglob("*") if f.is_file()) > 1e6
    again = subprocess.run(run, capture_output=True, text=True, env=env, cwd=REPO)
    assert again.returncode == 0 and "compiled before" in json.loads(again.stdout)["skipped"]
