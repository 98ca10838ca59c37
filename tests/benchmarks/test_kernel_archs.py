"""benchmarks/kernel_archs.py on the installed vLLM 0.22's own libraries (no GPU): which kernels an
H100 (sm_90) runs from machine code and which the driver JIT-compiles from PTX. Pinned against
vLLM's CMakeLists.txt: FlashAttention 3 is built for sm_90a only; the Marlin MoE kernels for
`8.0+PTX;12.0f` (no sm_90 SASS: "we always set use_atomic_add=False for moe marlin now, so we
don't need 9.0"), so an H100 JIT-compiles them from sm_80 PTX (the rehearsal's cold engine init,
BENCHMARKS.md fifth pass).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support import REPO
from tests.support.vllm_helpers import VLLM_PYTHON, need_vllm

PROBE = """
import json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import vllm
from kernel_archs import survey
root = Path(vllm.__file__).parent
print(json.dumps({name: survey(root / name, 90) for name in sys.argv[1:]}))
"""


@pytest.mark.vllm_env
@need_vllm
def test_marlin_moe_is_jit_compiled_on_sm90_and_flash_attention_3_is_not():
    libs = ["_moe_C.abi3.so", "vllm_flash_attn/_vllm_fa3_C.abi3.so"]
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", PROBE, *libs], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    moe, fa3 = (json.loads(proc.stdout)[name] for name in libs)
    assert fa3["units"] > 0 and fa3["jit_units"] == 0 and fa3["no_code_units"] == 0
    assert moe["jit_units"] > 0 and moe["jit_from"] == ["sm_80"] and moe["jit_ptx_bytes"] > 1e6
    assert "SASS sm_90" in moe["entries"]  # its other units (e.g. routing) run natively
