"""evaluate-vllm's engine processes (eyrie.evaluate.vllm_run.EngineWorkers): started with the
stage, each waits for its request file, and one given no request is stopped. The worker here is
a stand-in process (no vLLM on this machine) that waits with the real wait_for_request and
answers with fixed outputs; the real worker runs in the GPU tests."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from eyrie.core.errors import EvaluateError
from eyrie.evaluate.vllm_run import EngineWorkers, wait_for_request

STAND_IN_WORKER = """
import json, os, sys
from pathlib import Path
from eyrie.evaluate.vllm_run import wait_for_request
req, res = map(Path, sys.argv[1:3])
Path(str(res) + ".pid").write_text(str(os.getpid()))
request = wait_for_request(req, os.getppid())
if request is None or request.get("fail"):
    sys.exit(0 if request is None else 1)
prompts = request["prompts"][: request.get("answer", len(request["prompts"]))]
env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
res.write_text(json.dumps({"outputs": [[len(p)] for p in prompts], "env": env}))
"""


def stand_in_workers() -> EngineWorkers:
    return EngineWorkers([sys.executable, "-c", STAND_IN_WORKER])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_a_request_runs_and_the_unused_worker_is_stopped():
    with stand_in_workers() as workers:
        folder = workers.paths("baseline")[0].parent
        result = workers.run("baseline", {"prompts": [[1, 2], [3]]})
        assert result["outputs"] == [[2], [1]]
        spec = workers.procs["speculative"]
        assert spec.poll() is None  # still waiting for its request
    assert spec.returncode is not None and not folder.exists()


@pytest.mark.slow
def test_a_failed_worker_is_one_line():
    with stand_in_workers() as workers:
        with pytest.raises(EvaluateError, match=r"^the vLLM speculative run failed \(exit 1\)"):
            workers.run("speculative", {"prompts": [[1]], "fail": True})


@pytest.mark.slow
def test_a_worker_returning_too_few_outputs_fails():
    with stand_in_workers() as workers:
        with pytest.raises(EvaluateError, match="returned 1 outputs for 2 prompts"):
            workers.run("baseline", {"prompts": [[1], [2]], "answer": 1})


def test_wait_for_request_reads_the_file_once_renamed_into_place(tmp_path):
    path = tmp_path / "r.json"

    def later():
        time.sleep(0.2)
        (tmp_path / "r.partial").write_text(json.dumps({"prompts": [[7]]}))
        (tmp_path / "r.partial").rename(path)

    thread = threading.Thread(target=later)
    thread.start()
    assert wait_for_request(path, os.getppid(), poll_s=0.01) == {"prompts": [[7]]}
    thread.join()


def test_wait_for_request_gives_up_when_the_parent_is_gone(tmp_path):
    assert wait_for_request(tmp_path / "never.json", parent=-1, poll_s=0.01) is None


@pytest.mark.slow
def test_workers_stop_when_the_check_fails():
    """A plan that raises inside the block: both workers are stopped, nothing is left."""
    pids: list[int] = []
    with pytest.raises(EvaluateError, match="the check"):
        with stand_in_workers() as workers:
            for name in workers.NAMES:
                pid_file = Path(str(workers.paths(name)[1]) + ".pid")
                deadline = time.monotonic() + 30
                while not pid_file.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
                pids.append(int(pid_file.read_text()))
            raise EvaluateError("the check failed")
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)


@pytest.mark.slow
@pytest.mark.parametrize("user", [None, "1"])
def test_the_engines_run_on_the_runner_vllm_or_the_user_picks(monkeypatch, user):
    """eyrie sets no model runner (docs/vllm.md): an engine process sees the user's
    VLLM_USE_V2_MODEL_RUNNER, or none; the greedy runs' sampler switch is eyrie's default."""
    if user is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", user)
    with stand_in_workers() as workers:
        env = workers.run("baseline", {"prompts": [[1]]})["env"]
    assert env.get("VLLM_USE_V2_MODEL_RUNNER") == user
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0")
