"""Resume from the newest checkpoint that verifies: a cut, garbled or unreadable newest step
folder is skipped with one line saying why, the older one resumes to the weights of an
uninterrupted run, and pruning never leaves the run without a good checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyrie.train import checkpoint
from eyrie.train.recipe import train
from tests.support.train_helpers import assert_weights, train_paths, train_settings, weights

# Every test trains (and resumes) real runs of 27 steps: the slow tier.
pytestmark = pytest.mark.slow

SETTINGS = train_settings(epochs=2, checkpoint_every=4)  # 27 steps; checkpoints every 4


def run_train(world, root, **kw):
    paths = train_paths(world, root)
    return train(paths, SETTINGS, **kw)


@pytest.fixture(scope="module")
def full(world, tmp_path_factory):
    """An uninterrupted run: what every resumed run must end with."""
    root = tmp_path_factory.mktemp("full")
    run_train(world, root)
    return root


@pytest.fixture(scope="module")
def stopped(world, tmp_path_factory):
    """A run stopped after step 8: its run folder holds step_00000004 and step_00000008."""
    root = tmp_path_factory.mktemp("stopped")
    assert run_train(world, root, stop_after_steps=8) is None
    return root


def copy_of(stopped, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(stopped, root)
    (run,) = (root / "state").iterdir()
    assert sorted(p.name for p in run.iterdir() if p.is_dir() and p.name != "tensorboard") == [
        "step_00000004",
        "step_00000008",
    ]
    return root, run


def assert_same_as_full(full, root) -> None:
    assert_weights(weights(full), weights(root), exact=True)

    def losses(r):
        return [json.loads(ln)["loss"] for ln in (r / "train" / "metrics.jsonl").open()]

    assert losses(full) == losses(root)


def lines(caplog, word: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(word)]


def one_line(caplog, word: str, pattern: str) -> None:
    """Exactly one logged line starts with `word`, and it is all of `pattern`."""
    (line,) = lines(caplog, word)
    assert re.fullmatch(pattern, line), line


def cut_weights(ckpt):
    """model.safetensors cut in half (a copy that stopped early, a full disk before fsync)."""
    f = ckpt / "model.safetensors"
    size = f.stat().st_size
    os.truncate(f, size // 2)
    return rf"model\.safetensors is {size // 2:,} bytes, its header says {size:,}: truncated"


def garble_state(ckpt):
    """state.pt overwritten with other bytes of the same length."""
    f = ckpt / "state.pt"
    size = f.stat().st_size
    f.write_bytes((bytes(range(256)) * (size // 256 + 1))[:size])
    return (
        rf"state\.pt is {size:,} bytes without the zip directory a torch\.save archive ends "
        r"with: cut short or overwritten"
    )


def cut_position(ckpt):
    """position.json cut mid-way: not JSON."""
    f = ckpt / "position.json"
    f.write_text(f.read_text()[:20])
    return r"position\.json does not parse: .+"


def other_draft(ckpt):
    """model.safetensors of another draft: complete, but one tensor of another shape."""
    f = ckpt / "model.safetensors"
    weights = load_file(str(f))
    name = sorted(weights)[0]
    weights[name] = torch.zeros(3, 5)
    save_file(weights, str(f))
    return (
        r"model\.safetensors does not fit the draft: 1 tensor\(s\) differ in name or shape, "
        rf"first {re.escape(name)} with shape \(3, 5\) here, \([\d, ]+\) in the draft"
    )


@pytest.mark.parametrize("corrupt", [cut_weights, other_draft, garble_state, cut_position])
def test_a_bad_newest_checkpoint_is_skipped_for_the_older_one(
    world, full, stopped, tmp_path, caplog, corrupt
):
    root, run = copy_of(stopped, tmp_path)
    why = corrupt(run / "step_00000008")
    with caplog.at_level("INFO", logger="eyrie.train"):
        summary = run_train(world, root)
    one_line(
        caplog,
        "skipped checkpoint",
        rf"skipped checkpoint {re.escape(str(run))}/step_00000008 \({why}\); "
        rf"resuming from {re.escape(str(run))}/step_00000004",
    )
    assert lines(caplog, "resumed from") == [
        f"resumed from {run}/step_00000004 (step 4, epoch 0, step 4 of the epoch)"
    ]
    assert summary["resumed_from_step"] == 4
    assert_same_as_full(full, root)


def test_no_checkpoint_verifies_trains_from_step_0_and_keeps_them_until_one_is_saved(
    world, full, stopped, tmp_path, caplog
):
    root, run = copy_of(stopped, tmp_path)
    why4, why8 = cut_position(run / "step_00000004"), cut_weights(run / "step_00000008")
    before = {p.relative_to(run): p.read_bytes() for p in run.glob("step_*/*")}

    class Crash(Exception):
        pass

    def crash(step):
        if step == 2:
            raise Crash

    with caplog.at_level("INFO", logger="eyrie.train"), pytest.raises(Crash):
        run_train(world, root, on_step=crash)
    assert [re.sub(r" \(.*\)$", "", ln) for ln in lines(caplog, "skipped checkpoint")] == [
        f"skipped checkpoint {run}/step_00000008",
        f"skipped checkpoint {run}/step_00000004",
    ]
    assert re.search(why4, lines(caplog, "skipped checkpoint")[1])
    assert lines(caplog, "no checkpoint") == [
        f"no checkpoint in {run} verifies: training from step 0 (the 2 skipped stay until its "
        "first checkpoint is saved)"
    ]
    # nothing better exists yet: the bad ones are all there, byte for byte
    assert {p.relative_to(run): p.read_bytes() for p in run.glob("step_*/*")} == before

    caplog.clear()
    with caplog.at_level("INFO", logger="eyrie.train"):
        summary = run_train(world, root)
    assert summary["resumed_from_step"] == 0 and not lines(caplog, "resumed from")
    # step 4's bad folder is replaced by the new step 4; step 8's goes once step 4 is saved
    one_line(
        caplog,
        "removed checkpoint",
        rf"removed checkpoint {re.escape(str(run))}/step_00000008 \({why8}\): "
        rf"{re.escape(str(run))}/step_00000004 is saved",
    )
    assert_same_as_full(full, root)


def test_pruning_never_removes_the_last_good_checkpoint(world, full, stopped, tmp_path, caplog):
    """Bad folders above the good step 8 (an empty step_16 and step_20, and step_10 whose
    position says step 8) took the KEEP_CHECKPOINTS slots: saving step 12 kept the two bad
    newest and removed 8 and 12, the only good ones. Now the bad go and 8 and 12 stay."""
    root, run = copy_of(stopped, tmp_path)
    shutil.copytree(run / "step_00000008", run / "step_00000010")
    (run / "step_00000016").mkdir()
    (run / "step_00000020").mkdir()

    class Crash(Exception):
        pass

    def crash(step):
        if step == 12:  # just after the step-12 checkpoint
            raise Crash

    with caplog.at_level("INFO", logger="eyrie.train"), pytest.raises(Crash):
        run_train(world, root, on_step=crash)
    assert lines(caplog, "skipped checkpoint") == [
        f"skipped checkpoint {run}/step_00000020 (position.json missing); resuming from "
        f"{run}/step_00000008",
        f"skipped checkpoint {run}/step_00000016 (position.json missing); resuming from "
        f"{run}/step_00000008",
        f"skipped checkpoint {run}/step_00000010 (position.json step is 8 but the folder is "
        f"step_00000010); resuming from {run}/step_00000008",
    ]
    assert len(lines(caplog, "removed checkpoint")) == 3
    assert sorted(p.name for p in run.iterdir() if p.is_dir() and p.name != "tensorboard") == [
        "step_00000008",
        "step_00000012",
    ]

    caplog.clear()
    with caplog.at_level("INFO", logger="eyrie.train"):
        summary = run_train(world, root)
    assert not lines(caplog, "skipped checkpoint") and summary["resumed_from_step"] == 12
    assert_same_as_full(full, root)


def test_under_two_processes_every_rank_resumes_from_the_checkpoint_rank_0_verified(
    world, tmp_path
):
    """A run stopped at step 4 (one process; the number of processes is not part of the run),
    its newest checkpoint cut, resumed by two: rank 0 verifies, skips step 4 and broadcasts
    step 2, both ranks load it, and the run ends with the weights of an uninterrupted one
    (up to DDP's float32 sum order, docs/training.md)."""
    from tests.support.train_helpers import DDP, eyrie_train, run_eyrie

    settings = train_settings(**DDP)  # checkpoints every 2 steps

    def paths(root):
        return train_paths(world, root)

    train(paths(tmp_path / "one"), settings)
    assert train(paths(tmp_path), settings, stop_after_steps=4) is None
    (run,) = (tmp_path / "state").iterdir()
    why = cut_weights(run / "step_00000004")
    proc = run_eyrie(eyrie_train(world, tmp_path, settings, "--nproc-per-node", "2"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    skipped = [ln for ln in proc.stderr.splitlines() if "skipped checkpoint" in ln]
    assert len(skipped) == 1, proc.stderr[-4000:]  # rank 0 only
    assert re.search(
        rf"skipped checkpoint {re.escape(str(run))}/step_00000004 \({why}\); resuming from "
        rf"{re.escape(str(run))}/step_00000002$",
        skipped[0],
    ), skipped[0]
    summary = json.loads((tmp_path / "train" / "train.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["world_size"] == 2
    assert_weights(weights(tmp_path / "one"), weights(tmp_path), exact=False)


def test_the_last_step_keeps_the_weights_alone_and_a_rerun_resumes_there(
    world, full, tmp_path, caplog
):
    """No optimizer state at the plan's last step (nothing is left to train): a rerun of the
    finished run reads the weights alone and writes the same outputs."""
    root = tmp_path / "run"
    shutil.copytree(full, root)
    (run,) = (root / "state").iterdir()
    folders = sorted(p for p in run.iterdir() if p.name.startswith("step_"))
    last, before = folders[-1], folders[-2]
    assert last.name == "step_00000027" and before.name == "step_00000024"
    assert sorted(p.name for p in last.iterdir()) == ["model.safetensors", "position.json"]
    assert (before / "state.pt").is_file()
    # no frozen tensor (the target's embedding) in any checkpoint: the build loads it
    stored = set(load_file(str(last / "model.safetensors")))
    assert stored and not any("embed_tokens" in k for k in stored)
    shutil.rmtree(root / "train")
    caplog.set_level("INFO")
    run_train(world, root)
    one_line(caplog, "resumed", rf"resumed from {re.escape(str(last))} \(step 27, epoch 1, .+\)")
    assert_same_as_full(full, root)


def test_a_checkpoint_of_an_older_eyrie_with_every_tensor_resumes(
    world, full, tmp_path, monkeypatch, caplog
):
    """Checkpoints written with the whole state_dict (frozen tensors included), as before:
    a resume reads them and ends with the uninterrupted run's weights."""
    root = tmp_path / "old"
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "stored_state", lambda model: model.state_dict())
        assert run_train(world, root, stop_after_steps=8) is None
    (run,) = (root / "state").iterdir()
    assert any(
        "embed_tokens" in k for k in load_file(str(run / "step_00000008" / "model.safetensors"))
    )
    caplog.set_level("INFO")
    run_train(world, root)
    assert lines(caplog, "resumed from") == [
        f"resumed from {run}/step_00000008 (step 8, epoch 0, step 8 of the epoch)"
    ]
    assert_same_as_full(full, root)
