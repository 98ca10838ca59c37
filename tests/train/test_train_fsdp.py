"""Sharded training (train.fsdp: FSDP2) in real `eyrie train` processes on the CPU (gloo): two
sharded processes train the draft one process trains, a killed sharded run resumes exactly, a
checkpoint resumes across the two modes, and a block drafter trains sharded layer by layer as
it trains replicated."""

from __future__ import annotations

import json

import pytest

from eyrie.train.recipe import train
from tests.support.train_helpers import (
    BLOCK,
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

FSDP = dict(DDP, fsdp=True)


def two(world, root, settings: dict):
    """A 2-process run of `settings` in `root`: its stderr."""
    root.mkdir(parents=True, exist_ok=True)
    proc = run_eyrie(eyrie_train(world, root, settings, "--nproc-per-node", "2"), root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


@pytest.fixture(scope="module")
def sharded(world, tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    return root, two(world, root, train_settings(**FSDP))


@pytest.mark.slow
def test_two_sharded_processes_train_the_same_draft_as_one(world, sharded, tmp_path):
    """The shards hold what one process holds: the same steps, losses and weights within the
    float32 sum order (as DDP's); the run id is the same run's (train.fsdp is not in it)."""
    one = train(train_paths(world, tmp_path), train_settings(**DDP))
    root, log = sharded
    assert "sharded over 2 processes (train.fsdp)" in log
    saved = json.loads((root / "train" / "train.json").read_text())
    assert saved["world_size"] == 2 and saved["run_id"] == one["run_id"]
    assert saved["steps"] == one["steps"] > 10
    assert_weights(weights(tmp_path), weights(root), exact=False)
    for a, b in zip(metrics(tmp_path), metrics(root), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=RTOL)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=RTOL)


@pytest.mark.slow
def test_a_killed_sharded_run_resumes_exactly(world, sharded, tmp_path):
    """SIGKILL once the step-4 checkpoint (gathered whole, written by rank 0) exists; the same
    command resumes from it into the shards and ends with the uninterrupted run's weights."""
    log = start_and_kill(
        eyrie_train(world, tmp_path, train_settings(**FSDP), "--nproc-per-node", "2"), tmp_path, 4
    )
    assert not (tmp_path / "train").exists(), log
    resumed = two(world, tmp_path, train_settings(**FSDP))
    assert "resumed from" in resumed
    summary = json.loads((tmp_path / "train" / "train.json").read_text())
    assert summary["resumed_from_step"] >= 4
    assert_weights(weights(sharded[0]), weights(tmp_path), exact=True)
    assert [r["loss"] for r in metrics(sharded[0])] == [r["loss"] for r in metrics(tmp_path)]


@pytest.mark.slow
def test_one_processs_checkpoint_resumes_sharded(world, sharded, tmp_path):
    """Checkpoints are whole tensors either way: a run stopped in one process after 6 steps
    goes on sharded over two from its step-4 checkpoint, to the sharded run's weights."""
    assert train(train_paths(world, tmp_path), train_settings(**DDP), stop_after_steps=6) is None
    log = two(world, tmp_path, train_settings(**FSDP))
    assert "resumed from" in log and "sharded over 2 processes" in log
    assert_weights(weights(sharded[0]), weights(tmp_path), exact=False)


@pytest.mark.slow
def test_a_block_drafter_trains_sharded_as_replicated(world, tmp_path):
    """DSpark, its decoder layers sharded one by one: two sharded processes train the weights
    two DDP processes train (each rank draws the same anchors either way)."""
    block = dict(FSDP, method="dspark", block_size=BLOCK, epochs=2)
    two(world, tmp_path / "fsdp", train_settings(**block))
    two(world, tmp_path / "ddp", train_settings(**{**block, "fsdp": False}))
    assert_weights(weights(tmp_path / "ddp"), weights(tmp_path / "fsdp"), exact=False)
    exported = json.loads((tmp_path / "fsdp" / "train" / "draft" / "config.json").read_text())
    assert exported["architectures"] == ["DSparkDraftModel"]
