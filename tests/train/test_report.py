"""The first step's line says where torch.compile spent its time (eyrie.train.report), from torch's
own timers: read after a real compilation on the CPU (C++ instead of Triton kernels, the same
timers), nothing said where nothing was compiled, and no lowering where the graphs came from the
cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support import REPO

# a fresh process: torch's timers are per process, and other tests compile too
COMPILED = """
import torch
from eyrie.train.report import compile_breakdown
print(repr(compile_breakdown()))
f = torch.compile(lambda x: torch.nn.functional.gelu(x @ x).sum())
x = torch.randn(8, 8, requires_grad=True)
f(x).backward()
print(repr(compile_breakdown()))
"""


@pytest.mark.slow
def test_the_first_step_line_names_the_compile_phases_torch_timed(tmp_path):
    # a cache of its own: cold, every phase runs; the same again loads the graphs (no lowering)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))

    def lines() -> tuple[str, str]:
        proc = subprocess.run(
            [sys.executable, "-c", COMPILED],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        before, after = proc.stdout.strip().splitlines()[-2:]
        return before, after

    before, cold = lines()
    assert before == "''"
    for what in ("traced", "forward lowered", "backward lowered"):
        assert re.search(rf"{what} \d+\.\d s", cold), cold
    _, cached = lines()
    assert "traced" in cached and "lowered" not in cached, cached
