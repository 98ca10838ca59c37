"""eyrie.vllm.fatbin on the installed vLLM 0.22's own libraries: the fatbin units it reads are
the ones pyelftools finds (an independent ELF reader); the units an sm_90 GPU compiles from PTX are
those vLLM's CMakeLists.txt builds without sm_90 code (the Marlin MoE kernels,
`MARLIN_MOE_ARCHS "8.0+PTX;12.0f"`), never FlashAttention 3 (sm_90a only); and the kernel names
read from a unit's PTX carry vLLM's own ScalarType ids (read in the vLLM environment), one unit per
activation x weight type: bf16 x uint4b8 is the one a Kimi-K2.5 int4 target runs.
"""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import pytest

from eyrie.vllm import fatbin
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
    assert [list(fatbin.fatbin_section(p)) for p in libs] == json.loads(proc.stdout)
    for lib in libs:
        found = fatbin.units(lib)
        assert found
        with open(lib, "rb") as f:
            for unit in found:  # each unit is a whole fatbin: its header, then its entries
                f.seek(unit["offset"])
                magic, _, head, body = struct.unpack("<IHHQ", f.read(16))
                assert magic == fatbin.FATBIN_MAGIC and head + body == unit["length"]
                assert unit["entries"] and all(
                    e["ptx_bytes"] >= e["bytes"] for e in unit["entries"]
                )


@need_vllm
def test_on_sm90_the_marlin_moe_units_need_the_jit_and_flash_attention_3_does_not():
    root = vllm_root()
    todo = fatbin.pending(root, 90)
    by_lib = {}
    for unit in todo:
        by_lib.setdefault(Path(unit["lib"]).relative_to(root).as_posix(), []).append(unit)
    moe = by_lib["_moe_C.abi3.so"]
    entries = {u["offset"]: u["entries"] for u in fatbin.units(root / "_moe_C.abi3.so")}
    for unit in moe:  # sm_80 code and PTX, nothing for sm_90: "8.0+PTX"
        kinds = {(e["kind"], e["arch"]) for e in entries[unit["offset"]]}
        assert (fatbin.PTX, 80) in kinds and not any(a // 10 == 9 for _, a in kinds)
    assert not [lib for lib in by_lib if lib.startswith("vllm_flash_attn/")]
    assert [u["ptx_bytes"] for u in todo] == sorted((u["ptx_bytes"] for u in todo), reverse=True)
    # an A100 runs them from their sm_80 code: nothing of the MoE library to compile there
    assert not [u for u in fatbin.pending(root, 80) if u["lib"].endswith("_moe_C.abi3.so")]


@need_vllm
@pytest.mark.slow  # imports vLLM's scalar types, reads every MoE unit's PTX
def test_kernel_names_carry_vllms_scalar_type_ids():
    probe = (
        "import json; from vllm.scalar_type import scalar_types as s; "
        "print(json.dumps({n: s.__dict__[n].id for n in ('bfloat16', 'float16', 'uint4b8')}))"
    )
    proc = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids = json.loads(proc.stdout.strip().splitlines()[-1])
    root = vllm_root()
    labels = [
        fatbin.label(fatbin.kernel_names(u["lib"], u), {})
        for u in fatbin.pending(root, 90, [root / "_moe_C.abi3.so"])
    ]
    for act in ("bfloat16", "float16"):
        want = f"marlin_moe_wna16::Marlin<{ids[act]}, {ids['uint4b8']}>"
        assert labels.count(want) == 1, (want, labels)
