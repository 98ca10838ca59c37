"""Real `eyrie train` processes: torchrun + DDP against one process, and runs killed with SIGKILL
that resume exactly; plus the torchrun command builder.

Each subprocess pays the imports (torch, transformers, speculators), so the runs are shared
through module fixtures and kept to a few dozen tiny steps.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil

import pytest

from eyrie.cli import build_parser
from eyrie.cli import main as cli_main
from eyrie.core.errors import EyrieError
from eyrie.train.launch import Dist, Workers, launch_command, rdzv_port
from eyrie.train.recipe import train
from eyrie.train.train import worker_args
from tests.support.train_helpers import (
    DDP,
    RTOL,
    assert_weights,
    eyrie_train,
    metrics,
    run_eyrie,
    start_and_kill,
    train_paths,
    train_settings,
    weights,
)


@pytest.fixture(scope="module")
def one_process(world, tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    summary = train(
        train_paths(world, root),
        train_settings(**DDP),
    )
    return root, summary


@pytest.fixture(scope="module")
def two_processes(world, tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    proc = run_eyrie(eyrie_train(world, root, train_settings(**DDP), "--nproc-per-node", "2"), root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, proc


# ---------------------------------------------------------------- torchrun + DDP


@pytest.mark.slow
def test_two_processes_train_the_same_draft_as_one(one_process, two_processes):
    (one, summary), (two, proc) = one_process, two_processes
    assert "torch.distributed.run --standalone --nproc-per-node 2" in proc.stderr
    saved = json.loads((two / "train" / "train.json").read_text())
    assert saved["world_size"] == 2 and summary["world_size"] == 1
    assert saved["steps"] == summary["steps"] > 10 and saved["run_id"] == summary["run_id"]
    assert saved["dropped_packs"] == summary["dropped_packs"]
    assert_weights(weights(one), weights(two), exact=False)
    m1, m2 = metrics(one), metrics(two)
    assert (
        [r["step"] for r in m1] == [r["step"] for r in m2] == list(range(1, summary["steps"] + 1))
    )
    for a, b in zip(m1, m2):
        assert a["tokens"] == b["tokens"] and a["loss_tokens"] == b["loss_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=RTOL)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=RTOL)  # DDP averages, not sums
        for k in range(3):
            assert b[f"loss_{k}"] == pytest.approx(a[f"loss_{k}"], rel=RTOL, abs=1e-9)
    # one copy of the progress lines and of the curves (rank 0 only)
    assert proc.stderr.count(f"step {summary['steps']}/{summary['steps']} ") == 1
    events = list((two / "state" / saved["run_id"] / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, events


@pytest.fixture(scope="module")
def killed_ddp(world, tmp_path_factory):
    """A 2-process run killed (every process, SIGKILL) once its step-4 checkpoint exists."""
    root = tmp_path_factory.mktemp("killed")
    log = start_and_kill(
        eyrie_train(world, root, train_settings(**DDP), "--nproc-per-node", "2"), root, 4
    )
    assert not (root / "train").exists(), log
    return root


@pytest.mark.slow
def test_killed_ddp_run_resumes_exactly(world, killed_ddp, two_processes, tmp_path):
    root = tmp_path / "resumed"
    shutil.copytree(killed_ddp, root)
    proc = run_eyrie(eyrie_train(world, root, train_settings(**DDP), "--nproc-per-node", "2"), root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stderr
    summary = json.loads((root / "train" / "train.json").read_text())
    assert summary["resumed_from_step"] >= 4 and summary["world_size"] == 2
    assert_weights(weights(two_processes[0]), weights(root), exact=True)
    assert [r["loss"] for r in metrics(two_processes[0])] == [r["loss"] for r in metrics(root)]


@pytest.mark.slow
def test_killed_ddp_run_resumes_in_one_process(world, killed_ddp, one_process, tmp_path):
    """The number of processes is not part of the run: 2 processes' state resumes in 1."""
    shutil.copytree(killed_ddp, tmp_path / "copy")
    resumed = train(
        train_paths(world, tmp_path / "copy"),
        train_settings(**DDP),
    )
    assert resumed["resumed_from_step"] >= 4 and resumed["world_size"] == 1
    assert resumed["run_id"] == one_process[1]["run_id"]
    assert_weights(weights(one_process[0]), weights(tmp_path / "copy"), exact=False)


@pytest.mark.slow
def test_packs_per_step_not_divisible_by_processes_is_one_line(world, tmp_path):
    proc = run_eyrie(
        eyrie_train(world, tmp_path, train_settings(packs_per_step=3), "--nproc-per-node", "2"),
        tmp_path,
    )
    assert proc.returncode != 0
    # one complete line per rank that got to print it (torchrun stops the other rank once one
    # has failed, sometimes before it printed)
    lines = [ln for ln in proc.stderr.splitlines() if "eyrie train: error:" in ln]
    assert 1 <= len(lines) <= 2, proc.stderr[-4000:]
    for line in lines:
        assert re.fullmatch(
            r"eyrie train: error: rank [01]/2: train\.packs_per_step is 3 but the run "
            r"has 2 processes .*multiple of 2 \(e\.g\. 4\).*",
            line,
        ), line
    assert "torchrun exited with status" in proc.stderr
    assert not (tmp_path / "state").exists()


def test_packs_per_step_is_checked_against_world_size(world, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(
        EyrieError, match=r"packs_per_step is 6 but the run has 4 processes .*e\.g\. 8"
    ):
        train(train_paths(world, tmp_path), train_settings(packs_per_step=6))


# ---------------------------------------------------------------- one process killed


@pytest.mark.slow
def test_killed_run_resumes_to_identical_weights(world, tmp_path, caplog):
    settings = train_settings(epochs=4, checkpoint_every=2)
    full = train(
        train_paths(world, tmp_path / "a"),
        settings,
    )
    b = tmp_path / "b"
    cmd = eyrie_train(world, b, settings, threads=1)  # the thread count of this test session
    log = start_and_kill(cmd, b, 4)
    assert not (b / "train").exists(), log
    with caplog.at_level("INFO", logger="eyrie.train"):
        assert cli_main(cmd[3:]) == 0
    assert "resumed from" in caplog.text
    resumed = json.loads((b / "train" / "train.json").read_text())
    assert 4 <= resumed["resumed_from_step"] < full["steps"] == resumed["steps"]
    assert_weights(weights(tmp_path / "a"), weights(b), exact=True)
    assert [r["loss"] for r in metrics(tmp_path / "a")] == [r["loss"] for r in metrics(b)]


# ---------------------------------------------------------------- the command


def test_torchrun_command_one_node():
    cmd = launch_command(["train", "--x", "1"], Workers(4, 1), {}, "/py")
    assert cmd == [
        "/py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "--module",
        "eyrie",
        "train",
        "--x",
        "1",
    ]


def test_torchrun_command_several_nodes_under_slurm():
    env = {"SLURM_JOB_ID": "4711", "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_NUM_NODES": "2"}
    cmd = launch_command(["train"], Workers(8, 2), env, "/py", first_host="gpu03")
    assert cmd == [
        "srun",
        "--nodes",
        "2",
        "--ntasks-per-node",
        "1",
        "--kill-on-bad-exit=1",
        "/py",
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--rdzv-backend",
        "c10d",
        "--rdzv-id",
        "4711",
        "--rdzv-endpoint",
        f"gpu03:{29400 + 711}",
        "--module",
        "eyrie",
        "train",
    ]
    assert rdzv_port({**env, "MASTER_PORT": "12345"}) == 12345


def test_torchrun_command_refuses_what_cannot_work():
    with pytest.raises(EyrieError, match="--nnodes 2 needs a SLURM allocation"):
        launch_command(["train"], Workers(8, 2), {}, "/py")
    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1"}
    with pytest.raises(EyrieError, match="--nnodes 2 but SLURM job 1 has 1 node"):
        launch_command(["train"], Workers(8, 2), env, "/py", first_host="n1")
    with pytest.raises(EyrieError, match="both must be >= 1"):
        launch_command(["train"], Workers(0, 1), {}, "/py")


def test_worker_arguments_parse_back_to_the_same_namespace(tmp_path):
    argv = [
        "--threads",
        "8",
        "train",
        "--target",
        "t",
        "--preflight",
        "p.json",
        "--vocab",
        "v",
        "--shards",
        "a.h5",
        "b.h5",
        "--out-dir",
        "o",
        "--state-dir",
        "s",
        "--settings",
        json.dumps({"train": {"epochs": 2}}),
        "--nproc-per-node",
        "4",
        "--nnodes",
        "2",
        "--stop-after-steps",
        "5",
    ]
    args = build_parser("train").parse_args(argv)
    again = build_parser("train").parse_args(worker_args(args))
    assert vars(again) == vars(args)
    assert isinstance(args, argparse.Namespace)


def test_dist_from_env():
    assert Dist.from_env({}) == Dist()
    d = Dist.from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (d.rank, d.world, d.local_rank, d.local_world, d.main) == (3, 4, 1, 2, False)
