"""Smoke test of the local SLURM cluster that scripts/slurm-local.sh brings up: a GPU job gets
CUDA_VISIBLE_DEVICES, is charged to the `eyrie` account in accounting, and an impossible GPU
request is refused. Skipped when no such cluster answers (start one with
`sudo scripts/slurm-local.sh up`)."""

import os
import re
import shutil
import subprocess
import time

import pytest

from tests.support import REPO

pytestmark = pytest.mark.slurm

SCRIPT = REPO / "scripts" / "slurm-local.sh"


def run(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Runs one command under a hard timeout and returns it finished, whatever its exit status."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def unavailable(reason: str) -> None:
    """Skip, except where the cluster is part of the setup (.ci/run sets EYRIE_REQUIRE_SLURM,
    as for tests/workflow/test_slurm.py): there a missing cluster is a failure."""
    (pytest.fail if os.environ.get("EYRIE_REQUIRE_SLURM") else pytest.skip)(reason)


@pytest.fixture(scope="module")
def cluster() -> None:
    if shutil.which("sinfo") is None:
        unavailable("no SLURM here (sinfo not on PATH): run `scripts/slurm-local.sh up` as root")
    status = run("bash", str(SCRIPT), "status", timeout=90)
    if status.returncode != 0:
        unavailable(
            f"local SLURM is not up ({(status.stdout + status.stderr).strip()}): "
            "run `scripts/slurm-local.sh up` as root"
        )


@pytest.fixture(scope="module")
def gpu_job(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Runs one 2-GPU batch job to its end; returns its id and its output. Polls the controller
    itself: `sbatch --wait` sleeps 2, 4, 8 s between its checks."""
    out = tmp_path_factory.mktemp("slurm") / "job.out"
    sub = run(
        "sbatch",
        "--parsable",
        "-A",
        "eyrie",
        "-p",
        "gpu",
        "--gpus=2",
        "-t",
        "2",
        "-o",
        str(out),
        "--wrap",
        "echo $CUDA_VISIBLE_DEVICES",
    )
    assert sub.returncode == 0, f"sbatch failed ({sub.returncode}): {sub.stderr.strip()}"
    job_id = sub.stdout.strip().split(";")[0]
    state = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        show = run("scontrol", "show", "job", "-o", job_id)
        found = re.search(r"JobState=(\S+)", show.stdout)
        state = found.group(1) if found else show.stderr.strip()
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            break
        time.sleep(0.2)
    else:
        run("scancel", job_id)
    assert state == "COMPLETED", f"job {job_id} ended {state!r}; see {out}"
    return job_id, out.read_text()


def test_gpu_job_sees_two_devices(gpu_job: tuple[str, str]) -> None:
    job_id, output = gpu_job
    match = re.fullmatch(r"(\d+),(\d+)\n", output)
    assert match, f"job {job_id}: expected two GPU indices like '0,1', got {output!r}"
    indices = {int(i) for i in match.groups()}
    assert len(indices) == 2 and indices <= {0, 1, 2, 3}, f"job {job_id}: bad indices {output!r}"


def test_job_is_accounted_completed(gpu_job: tuple[str, str]) -> None:
    job_id, _ = gpu_job
    row = ""
    deadline = time.monotonic() + 30  # the controller sends the end record to slurmdbd async
    while time.monotonic() < deadline:
        acct = run("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,Account,AllocTRES")
        assert acct.returncode == 0, f"sacct failed: {acct.stderr.strip()}"
        row = acct.stdout.strip()
        if row.startswith("COMPLETED|"):
            break
        time.sleep(0.5)
    state, account, tres = row.split("|") if row.count("|") == 2 else (row, "", "")
    assert state == "COMPLETED", f"job {job_id}: sacct says {row!r}"
    assert account == "eyrie"
    assert "gres/gpu=2" in tres, f"job {job_id}: AllocTRES {tres!r} lacks gres/gpu=2"


def test_more_gpus_than_the_node_has_are_refused(cluster: None) -> None:
    sub = run("sbatch", "--parsable", "-p", "gpu", "--gpus=5", "--wrap", "true")
    if sub.returncode == 0:  # wrongly accepted: do not leave it pending
        run("scancel", sub.stdout.strip().split(";")[0])
    assert sub.returncode != 0, "sbatch accepted --gpus=5 on a node with 4 GPUs"
    assert "Requested node configuration is not available" in sub.stderr, sub.stderr


def test_unknown_account_is_refused(cluster: None) -> None:
    sub = run("sbatch", "--parsable", "-A", "no-such-account", "--wrap", "true")
    if sub.returncode == 0:
        run("scancel", sub.stdout.strip().split(";")[0])
    assert sub.returncode != 0, "sbatch accepted an account missing from slurmdbd"
    assert "Invalid account" in sub.stderr, sub.stderr
