"""The workflow through a real SLURM: `snakemake --profile slurm-gpu` (the project's profile,
found by name from the repository root) against the single-node cluster that
scripts/slurm-local.sh brings up (fake GPUs, accounting). Test overrides: fast status polling,
the `eyrie` account, two training GPUs. Every Snakemake call runs under a hard timeout."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.stages import demo_conversations
from tests.support.workflow import job_table, write_config

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

POLL = ["--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1"]
ENV = {**os.environ, "EYRIE_SLURM_ACCOUNT": "eyrie", "EYRIE_TRAIN_GPUS": "2"}
RUN_TIMEOUT_S = 900


def cluster_problem() -> str | None:
    if shutil.which("sinfo") is None:
        return "no SLURM here: run `bash scripts/slurm-local.sh up` (as root) first"
    status = subprocess.run(
        ["bash", str(REPO / "scripts/slurm-local.sh"), "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if status.returncode != 0:
        return f"the local SLURM is not up ({status.stdout.strip()} {status.stderr.strip()})"
    if not (REPO / "slurm-gpu" / "config.yaml").is_file():
        return "./slurm-gpu is missing: scripts/setup.sh links it to profiles/slurm-gpu"
    return None


@pytest.fixture(scope="module", autouse=True)
def cluster():
    problem = cluster_problem()
    if problem:
        # In CI the cluster is part of the setup (.ci/run): a missing one is a failure there.
        if os.environ.get("EYRIE_REQUIRE_SLURM"):
            pytest.fail(problem)
        pytest.skip(problem)


def profile_cmd(work: Path) -> list[str]:
    """`python -m snakemake --profile slurm-gpu` (polling fast) on `work`."""
    return [sys.executable, "-m", "snakemake", "--profile", "slurm-gpu", *POLL, "-d", str(work)]


def snakemake(
    work: Path,
    *args: str,
    check: bool = True,
    timeout: int = RUN_TIMEOUT_S,
    snakefile: Path | None = None,
) -> subprocess.CompletedProcess:
    """The literal profile lookup: run from the repository root with `--profile slurm-gpu`."""
    # last: --configfile takes every word after it
    last = ["--configfile", str(work / "config.yaml")] if snakefile is None else ["-s", snakefile]
    cmd = [*profile_cmd(work), *args, *map(str, last)]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        logs = "\n".join(
            f"--- {p}\n{p.read_text()[-2500:]}" for p in sorted(work.glob("logs/**/*.log"))
        )
        raise AssertionError(
            f"snakemake {' '.join(args)} failed:\n{(proc.stdout + proc.stderr)[-6000:]}\n{logs}"
        )
    return proc


def slurm_jobs(proc: subprocess.CompletedProcess) -> list[str]:
    """SLURM job ids this Snakemake run submitted."""
    return re.findall(r"SLURM jobid (\d+)", proc.stdout + proc.stderr)


def sacct(job: str, fields: str = "State,AllocTRES") -> list[str]:
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job, "-o", fields],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [ln for ln in out.splitlines() if ln.strip()]


def visible_gpus(log: Path) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as the job saw it (eyrie logs it first), None if it had none."""
    m = re.search(r"CUDA_VISIBLE_DEVICES=(\S*)", log.read_text())
    return m[1].split(",") if m else None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    work = tmp_path_factory.mktemp("slurm")
    write_config(work, train__packs_per_step=2)
    demo_conversations(work / "convs.jsonl", check=True, timeout=120)
    t0 = time.monotonic()
    proc = snakemake(work)
    return {"work": work, "proc": proc, "seconds": time.monotonic() - t0}


def test_profile_is_found_by_name_from_the_repository_root(built):
    out = built["proc"].stdout + built["proc"].stderr
    assert re.search(r"Using profiles? slurm-gpu", out)
    assert (built["work"] / "results/tiny/eval/eval.json").is_file()


def test_every_job_went_through_slurm_and_gpu_rules_got_gpus(built):
    work, proc = built["work"], built["proc"]
    jobs = slurm_jobs(proc)
    # one SLURM job per job, except the engine and its 4 shard jobs, which go as one group job,
    # and `all`, which has nothing to run
    planned = job_table(proc.stdout + proc.stderr)
    assert len(jobs) == sum(planned.values()) - planned["extract_hidden_states"] - planned["all"]
    for job in jobs:
        assert all(ln.startswith("COMPLETED") for ln in sacct(job)), sacct(job)
    logs = work / "logs/tiny"
    assert len(visible_gpus(logs / "extract_engine/engine_000.log")) == 1
    assert len(visible_gpus(logs / "train_draft.log")) == 2  # EYRIE_TRAIN_GPUS=2: torchrun, 2 ranks
    assert len(visible_gpus(logs / "evaluate_draft.log")) == 1
    for cpu_rule in ("tokenize_conversations", "preflight", "build_vocab_map"):
        text = (logs / f"{cpu_rule}.log").read_text()
        assert "SLURM_JOB_ID=" in text and visible_gpus(logs / f"{cpu_rule}.log") is None
    gpu_tres = [ln for job in jobs for ln in sacct(job) if "gres/gpu=" in ln]
    assert sorted(re.search(r"gres/gpu=(\d+)", ln)[1] for ln in gpu_tres) == ["1", "1", "2"]
    train = (logs / "train_draft.log").read_text()
    assert "torch.distributed.run" in train or "torchrun" in train


def test_second_run_submits_nothing(built):
    proc = snakemake(built["work"])
    assert "Nothing to be done" in proc.stdout + proc.stderr and slurm_jobs(proc) == []


def test_one_shard_asked_for_rebuilds_alone_in_one_job(built, tmp_path):
    work = tmp_path / "wf"
    shutil.copytree(
        built["work"], work, symlinks=True, ignore=shutil.ignore_patterns("*.sock", ".snakemake")
    )
    shutil.copytree(
        built["work"] / ".snakemake",
        work / ".snakemake",
        symlinks=True,
        ignore=shutil.ignore_patterns("*.sock", "locks", "incomplete"),
    )
    # without the output store, which would restore the shard
    # (tests/workflow/test_reliability_outputs.py)
    write_config(work, train__packs_per_step=2, store__path=None)
    target = "results/tiny/hidden/shard_001.h5"
    (work / target).unlink()
    proc = snakemake(work, target)
    assert job_table(proc.stdout + proc.stderr) == {"extract_engine": 1, "extract_hidden_states": 1}
    assert len(slurm_jobs(proc)) == 1  # the engine and its client, one allocation, one model load
    log = (work / "logs/tiny/extract_engine/engine_000.log").read_text()
    assert log.count("engine: loaded target") == 1 and "shard_001" in log and "shard_000" not in log


@pytest.mark.parametrize("kill", ["scancel", "SIGKILL"])
def test_shards_killed_mid_write_leave_nothing_that_looks_complete(built, tmp_path, kill):
    """The engine's group job killed while it writes a shard: by `scancel` (SLURM signals the
    job; the engine unwinds and removes its temporary file) or by SIGKILL of the engine (a dead
    node: nothing runs, the temporary stays). Either way Snakemake reports the failure, no file
    carries a shard's name unless it is complete, and the next run finishes the work. The copy
    holds 40 distinct copies of each conversation, so that a shard takes about a second to write."""
    from eyrie.formats.hidden import ShardReader

    work = tmp_path / "wf"
    shutil.copytree(built["work"], work, symlinks=True, ignore=shutil.ignore_patterns("*.sock"))
    records = [json.loads(ln) for ln in (work / "convs.jsonl").read_text().splitlines()]
    copies = []
    for i in range(40):  # each copy made distinct: tokenization drops exact duplicates
        for rec in records:
            first = dict(rec["messages"][0], content=f"({i}) {rec['messages'][0]['content']}")
            copies.append(json.dumps({**rec, "messages": [first, *rec["messages"][1:]]}))
    (work / "convs.jsonl").write_text("".join(f"{c}\n" for c in copies))
    # no output store: the shards are extracted, not restored
    # (tests/workflow/test_reliability_outputs.py)
    write_config(work, train__packs_per_step=2, store__path=None)
    hidden = work / "results/tiny/hidden"
    engine_log = work / "logs/tiny/extract_engine/engine_000.log"
    shards = [f"results/tiny/hidden/shard_{i:03d}.h5" for i in range(4)]
    cmd = [*profile_cmd(work), "--retries", "0", *shards, "--configfile", str(work / "config.yaml")]
    run = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 400
        while not list(hidden.glob(".shard_*.h5.tmp-*")):  # a shard being written
            assert time.monotonic() < deadline and run.poll() is None, "no shard was ever written"
            time.sleep(0.05)
        if kill == "scancel":
            jobs = subprocess.run(
                ["squeue", "-h", "-o", "%i", "-p", "gpu"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
            assert len(jobs) == 1, jobs  # the engine's group job
            subprocess.run(["scancel", *jobs], check=True, timeout=30)
        else:
            pid = int(
                re.search(r"engine: listening on \S+ \(pid (\d+)\)", engine_log.read_text())[1]
            )
            os.kill(pid, signal.SIGKILL)
        # Snakemake notices within its status polling (a cancelled job reads "CANCELLED by 0"
        # in sacct: scripts/slurm-shims/sacct is what lets the plugin see it at all)
        out, _ = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode != 0, out[-3000:]
    group_job = re.findall(r"SLURM jobid (\d+)", out)[-1]
    assert sacct(group_job, "State")[0].startswith("CANCELLED" if kill == "scancel" else "FAILED")
    left = list(hidden.glob(".shard_*.h5.tmp-*"))
    assert bool(left) == (
        kill == "SIGKILL"
    )  # SIGKILL runs no cleanup; the name never passes for a shard
    done = [s for s in shards if (work / s).exists()]
    assert len(done) < len(shards)
    for s in done:  # whatever carries a shard's name is complete
        ShardReader(work / s).close()
    proc = snakemake(work, *shards)
    assert job_table(proc.stdout + proc.stderr) == {
        "extract_engine": 1,
        "extract_hidden_states": len(shards) - len(done),
    }
    for s in shards:
        ShardReader(work / s).close()
    assert not list(hidden.glob(".shard_*.h5.tmp-*"))  # the rewrite removed what the kill left


def test_a_job_killed_for_its_time_limit_is_retried_with_more_time(tmp_path):
    """The profile's retries with attempt-scaled runtime: 1 minute, then 2 (here for a rule that
    needs 75 s; the profile's own values are 60 * attempt minutes and up)."""
    (tmp_path / "Snakefile").write_text(
        "rule slow:\n"
        '    output: "done.txt"\n'
        '    shell: "sleep 75 && echo {resources.runtime} > {output}"\n'
    )
    proc = snakemake(
        tmp_path,
        "--set-resources",
        "slow:runtime=attempt",
        snakefile=tmp_path / "Snakefile",
        timeout=600,
    )
    jobs = slurm_jobs(proc)
    assert len(jobs) == 2
    assert sacct(jobs[0], "State")[0].startswith("TIMEOUT")
    assert sacct(jobs[1], "State")[0].startswith("COMPLETED")
    assert (tmp_path / "done.txt").read_text().strip() == "2"
