"""benchmarks/failure.py: the cause line of a failed child, on output as the children print it
(vLLM 0.22's engine core and client, torch's OOM, eyrie.cli, torchrun, bash, Snakemake 9.27)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support import REPO


@pytest.fixture(scope="module")
def failure():
    """benchmarks/failure.py as the scripts import it (they run as `python benchmarks/x.py`)."""
    spec = importlib.util.spec_from_file_location("failure", REPO / "benchmarks" / "failure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total "
    "capacity of 79.19 GiB of which 1.23 GiB is free. Including non-PyTorch memory, this process "
    "has 77.95 GiB memory in use. Of the allocated memory 75.10 GiB is allocated by PyTorch, and "
    "1.21 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
    "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
ENGINE = "(EngineCore pid=4242) "
LOGGED = ENGINE + "ERROR 12-06 10:01:13 [core.py:1165] "  # logger.exception's prefix, every line
FRAMES = [
    '  File "/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 1139, in '
    "run_engine_core",
    "    engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)",
    '  File "/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 253, in '
    "_initialize_kv_caches",
    "    available_gpu_memory = self.model_executor.determine_available_memory()",
    '  File "/venv/lib/python3.11/site-packages/vllm/v1/worker/gpu_worker.py", line 373, in '
    "determine_available_memory",
    "    self.model_runner.profile_run()",
]
# A capture-path extraction child whose engine core ran out of GPU memory while profiling, as
# vLLM 0.22 prints it: the engine's logger.exception (core.py), multiprocessing's own traceback
# of the dead process, then the client's wrapper (utils.py wait_for_engine_startup).
VLLM_OOM = "\n".join(
    [
        "INFO 12-06 10:00:02 [utils.py:233] non-default args: {'load_format': 'dummy'}",
        ENGINE + "INFO 12-06 10:00:09 [core.py:96] Initializing a V1 LLM engine (v0.22.0)",
        ENGINE + "WARNING 12-06 10:00:10 [fused_moe.py:88] ImportError: no triton_kernels; "
        "using the default MoE kernels",
        LOGGED + "EngineCore failed to start.",
        LOGGED + "Traceback (most recent call last):",
        *(LOGGED + frame for frame in FRAMES),
        LOGGED + OOM,
        ENGINE + "Process EngineCore:",
        ENGINE + "Traceback (most recent call last):",
        *(ENGINE + frame for frame in FRAMES),
        ENGINE + OOM,
        "[rank0]:[W1206 10:01:14.123456 ProcessGroupNCCL.cpp:1496] Warning: WARNING: "
        "destroy_process_group() was not called before program exit",
        "Traceback (most recent call last):",
        '  File "/work/benchmarks/extraction_vllm.py", line 289, in child_eyrie',
        "    ex = Extractor(root / shape, root / f'{shape}-preflight.json', settings(...))",
        '  File "/venv/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1209, in '
        "wait_for_engine_startup",
        "    raise RuntimeError(",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {'EngineCore': 1}",
    ]
)


def test_vllm_engine_core_oom_gives_the_root_cause_not_the_wrapper(failure):
    assert failure.cause(VLLM_OOM) == OOM
    row = failure.failed(1, VLLM_OOM)
    assert row["error"] == "exit 1" and row["cause"] == OOM
    assert row["tail"] == VLLM_OOM[-4000:]
    assert failure.why(row) == f"exit 1: {OOM}"
    # dead after startup: EngineDeadError's "see stack trace (above)" points at the same line
    dead = VLLM_OOM.replace("EngineCore failed to start.", "EngineCore encountered a fatal error.")
    dead += (
        "\nvllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack "
        "trace (above) for the root cause."
    )
    assert failure.cause(dead) == OOM


def test_an_engine_killed_by_the_oom_killer_is_named_by_its_signal(failure):
    """No root cause above (SIGKILL leaves no traceback): the wrapper, its -9 named."""
    text = "\n".join(VLLM_OOM.splitlines()[:3] + VLLM_OOM.splitlines()[-6:])
    text = text.replace("{'EngineCore': 1}", "{'EngineCore': -9}")
    assert failure.cause(text) == (
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {'EngineCore': -9 (SIGKILL, often the kernel's OOM killer)}"
    )


def test_eyrie_one_line_error_among_its_log(failure):
    text = (
        "2026-12-06 10:00:00,123 eyrie.cli INFO eyrie extract on gpu-3: CUDA_VISIBLE_DEVICES=0\n"
        "2026-12-06 10:00:01,000 eyrie.extract.extractor INFO opened the target\n"
        "eyrie extract: error: /w/kimi4-preflight.json: aux layer 61 out of range for 4 layers; "
        "rerun preflight\n"
    )
    line = (
        "eyrie extract: error: /w/kimi4-preflight.json: aux layer 61 out of range for 4 layers; "
        "rerun preflight"
    )
    assert failure.cause(text) == line
    assert failure.failed(2, text)["cause"] == line
    # a bug: eyrie.cli logs "unexpected" with its logging prefix, then the traceback
    bug = (
        "2026-12-06 10:00:00,000 eyrie.cli ERROR eyrie train: unexpected KeyError: 'x'\n"
        "Traceback (most recent call last):\n  File \"a.py\", line 1, in f\nKeyError: 'x'\n"
    )
    assert failure.cause(bug) == "KeyError: 'x'"


def test_python_traceback_gives_its_exception_line(failure):
    text = (
        "step 10 loss 1.52\n"
        "Traceback (most recent call last):\n"
        '  File "/work/eyrie/formats/hidden.py", line 212, in read\n'
        "    raise ValueError(f'{path}: hidden_states has {n} rows')\n"
        "ValueError: shard_003.h5: hidden_states has 1023 rows, input_ids 1024\n"
        "\n"
        "The above exception was the direct cause of the following exception:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "/work/eyrie/train/loop.py", line 88, in run\n'
        "eyrie.core.errors.DataError: shard_003.h5 is not a valid shard; re-extract it\n"
    )
    assert failure.cause(text) == (
        "eyrie.core.errors.DataError: shard_003.h5 is not a valid shard; re-extract it"
    )
    assert failure.cause("Traceback (most recent call last):\nException: boom") == "Exception: boom"
    assert failure.cause("step 1\nstep 2\nall done\n") is None


def test_sigkill_without_a_line_is_named_by_the_exit_status(failure):
    row = failure.failed(-9, "step 10 loss 1.52\nstep 20 loss 1.31\n")
    assert row == {
        "error": "exit -9 (killed by SIGKILL, often the kernel's OOM killer)",
        "cause": None,
        "tail": "step 10 loss 1.52\nstep 20 loss 1.31\n",
    }
    assert failure.why(row) == "exit -9 (killed by SIGKILL, often the kernel's OOM killer)"
    assert failure.exit_status(-15) == "exit -15 (killed by SIGTERM)"
    assert failure.exit_status(137) == (
        "exit 137 (128 + 9: a shell's child killed by SIGKILL, often the kernel's OOM killer)"
    )
    # bash reports its killed child; torchrun reports a killed rank under its wrapper
    bash = "step 20\nbenchmarks/gpu.sh: line 12:  4242 Killed      python3 train.py\n"
    assert failure.cause(bash) == "benchmarks/gpu.sh: line 12:  4242 Killed      python3 train.py"
    torchrun = (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "============================================================\n"
        "speculators/train.py FAILED\n"
        "Root Cause (first observed failure):\n"
        "[0]:\n"
        "  exitcode  : -9 (pid: 5151)\n"
        "  traceback : Signal 9 (SIGKILL) received by PID 5151\n"
    )
    assert failure.cause(torchrun) == "traceback : Signal 9 (SIGKILL) received by PID 5151"


# Snakemake 9.27.1's output for a failed shell job (show-failed-logs on), its rule and log
# renamed; the log's text is the vLLM OOM above.
SNAKEMAKE = """\
[Sun Dec  6 14:36:23 2026]
localrule extract_hidden_states:
    output: results/kimi4/hidden/shard_000.h5
    log: logs/kimi4/extract_hidden_states/shard_000.log
    jobid: 1
RuleException:
CalledProcessError in file "/work/rules/extract.smk", line 7:
Command 'set -euo pipefail;  eyrie extract ... > logs/kimi4/extract_hidden_states/shard_000.log \
2>&1' returned non-zero exit status 1.
[Sun Dec  6 14:36:23 2026]
Error in rule extract_hidden_states:
    message: None
    jobid: 1
    output: results/kimi4/hidden/shard_000.h5
    log: logs/kimi4/extract_hidden_states/shard_000.log (check log file(s) for error details)
    shell:
        eyrie extract ... > logs/kimi4/extract_hidden_states/shard_000.log 2>&1
        (command exited with non-zero exit code)
Error in rule train_draft:
    message: None
    jobid: 2
    log: logs/kimi4/train_draft.log (check log file(s) for error details)
Shutting down, this might take some time.
Exiting because a job execution failed. Look above for error messages
Complete log(s): /w/.snakemake/log/2026-12-06T143623.609299.snakemake.log
WorkflowError:
At least one job did not complete successfully.
"""


def test_snakemake_failures_name_each_rule_and_the_cause_in_its_log(failure, tmp_path):
    log = tmp_path / "logs/kimi4/extract_hidden_states/shard_000.log"
    log.parent.mkdir(parents=True)
    log.write_text(VLLM_OOM)
    assert failure.snakemake_failures(SNAKEMAKE, tmp_path) == [
        {
            "rule": "extract_hidden_states",
            "log": "logs/kimi4/extract_hidden_states/shard_000.log",
            "cause": OOM,
        },
        {"rule": "train_draft", "log": "logs/kimi4/train_draft.log", "cause": "log not written"},
    ]
    (tmp_path / "logs/kimi4/train_draft.log").write_text("step 10 loss 1.52\n")
    assert failure.snakemake_message(SNAKEMAKE, tmp_path).splitlines() == [
        f"rule extract_hidden_states: {OOM} (log: logs/kimi4/extract_hidden_states/shard_000.log)",
        "rule train_draft: no error line; it ends: step 10 loss 1.52 "
        "(log: logs/kimi4/train_draft.log)",
    ]


def test_snakemake_failing_before_any_job_gives_its_own_cause(failure, tmp_path):
    out = (
        "Building DAG of jobs...\n"
        'MissingInputException in rule all in file "/tmp/smk1/Snakefile", line 1:\n'
        "Missing input files for rule all:\n"
        "    affected files:\n"
        "        missing.txt\n"
    )
    assert failure.snakemake_failures(out, tmp_path) == [
        {
            "rule": None,
            "log": None,
            "cause": 'MissingInputException in rule all in file "/tmp/smk1/Snakefile", line 1: '
            "Missing input files for rule all:",
        }
    ]
