"""Draft training: forward/backward, a step over packs, loss falls, exact resume, shard checks
(packing and loading: test_packing.py)."""

from __future__ import annotations

import json
import os
import shutil

import h5py
import pytest
import torch
from safetensors.torch import load_file

from eyrie.cli import main as cli_main
from eyrie.config.sections import TrainSettings
from eyrie.core.errors import EyrieError, ShardError
from eyrie.formats.hidden import ShardMeta
from eyrie.train.inputs import VERIFIED_MARKER
from eyrie.train.packing import PackedShards, epoch_order, pack
from eyrie.train.recipe import train
from tests.support.train_helpers import (
    AUX_IDS,
    train_args,
    train_paths,
    train_settings,
    write_shard,
)


def run_train(world, root, settings, shards=None, **kw):
    return train(train_paths(world, root, shards), settings, **kw)


def test_forward_backward_trains_only_draft_weights(world):
    from speculators.losses import resolve_loss_config

    from eyrie.arch.draft import DraftSpec, build_draft
    from eyrie.formats.report import shard_expectation
    from eyrie.formats.vocab import read_vocab

    expect = shard_expectation(world["preflight"])
    data = PackedShards(world["shards"], expect, max_tokens=128, gap=2)
    d2t, t2d = read_vocab(world["vocab"])
    model = build_draft(world["target"], DraftSpec(AUX_IDS, ttt_steps=3), d2t, t2d, seed=0)
    _, loss, metrics = model(
        **data.batch([0, 1]), ttt_steps=3, loss_config=resolve_loss_config("kl_div", "eager")
    )
    assert torch.isfinite(loss) and loss > 0
    assert {f"full_acc_{k}_sum" for k in range(3)} <= set(metrics)
    loss.backward()
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0
    assert model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert model.embed_tokens.weight.grad is None and model.lm_head.weight.grad is None
    data.close()


def test_a_pack_padded_to_a_fixed_shape_trains_the_same(world):
    """train.pack_shape fixed (the GPU default: one shape for the compiled draft) pads each pack to
    max_tokens_per_batch outside the loss: the loss, the metrics and the gradients stay the same."""
    from speculators.losses import resolve_loss_config

    from eyrie.arch.draft import DraftSpec, build_draft
    from eyrie.formats.report import shard_expectation
    from eyrie.formats.vocab import read_vocab

    data = PackedShards(
        world["shards"], shard_expectation(world["preflight"]), max_tokens=128, gap=2
    )
    d2t, t2d = read_vocab(world["vocab"])
    out = {}
    for name, pad_to in (("exact", None), ("fixed", 128)):
        batch = data.batch([0, 1], pad_to=pad_to)
        assert batch["input_ids"].shape[1] == (128 if pad_to else data.tokens([0, 1])[0] + 2 * 2)
        model = build_draft(world["target"], DraftSpec(AUX_IDS, ttt_steps=3), d2t, t2d, seed=0)
        _, loss, metrics = model(
            **batch, ttt_steps=3, loss_config=resolve_loss_config("kl_div", "eager")
        )
        loss.backward()
        out[name] = (
            loss.detach(),
            {k: v.detach() for k, v in metrics.items()},
            model.fc.weight.grad.clone(),
        )
    (l0, m0, g0), (l1, m1, g1) = out["exact"], out["fixed"]
    assert torch.allclose(l0, l1, rtol=1e-5, atol=1e-7)
    for k in m0:
        assert torch.allclose(
            torch.as_tensor(m0[k]).float(), torch.as_tensor(m1[k]).float(), rtol=1e-5, atol=1e-6
        ), k
    assert torch.allclose(g0, g1, rtol=1e-4, atol=1e-7)
    data.close()


def test_loss_falls_and_outputs_are_written(world, tmp_path):
    summary = run_train(world, tmp_path, train_settings(epochs=5, log_every=7))
    records = [
        json.loads(ln) for ln in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == list(range(1, summary["steps"] + 1))
    first = sum(r["loss"] for r in records[:5]) / 5
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    acc0_first = sum(r["full_acc_0"] for r in records[:5]) / 5
    assert summary["final"]["full_acc"][0] > acc0_first
    out = tmp_path / "train"
    assert sorted(p.name for p in out.iterdir()) == [
        "curves.png",
        "draft",
        "metrics.jsonl",
        "tensorboard",
        "train.json",
    ]
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((out / "train.json").read_text())
    assert saved["steps"] == summary["steps"] and saved["tokens"] > 0 and saved["tokens_per_s"] > 0
    assert saved["provenance"]["settings"]["train"]["epochs"] == 5
    config = json.loads((out / "draft" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX_IDS


# train_settings(epochs=2, checkpoint_every=4) on the tiny world, CPU, float32: steps 1-6
PINNED_LOSSES = [0.0422352, 0.0311719, 0.0310989, 0.0239363, 0.0237341, 0.0253273]
PINNED_GRAD_NORMS = [0.143954, 0.0916425, 0.0669164, 0.0337197, 0.0289787, 0.0314863]


def test_interrupted_runs_resume_to_identical_weights(world, tmp_path):
    settings = train_settings(epochs=2, checkpoint_every=4)
    full = run_train(world, tmp_path / "a", settings)
    steps = full["steps"]
    assert steps > 10
    # The first steps' values, pinned: a change to what a training step computes shows here.
    first = [json.loads(ln) for ln in (tmp_path / "a" / "train" / "metrics.jsonl").open()][:6]
    assert [r["loss"] for r in first] == pytest.approx(PINNED_LOSSES, rel=1e-4)
    assert [r["grad_norm"] for r in first] == pytest.approx(PINNED_GRAD_NORMS, rel=1e-4)
    assert [(r["tokens"], r["loss_tokens"]) for r in first][:2] == [(117, 54), (69, 23)]

    b = tmp_path / "b"
    # 1. a planned stop through the CLI (checkpoint at step 3, exit code 3, no outputs)
    args = [*train_args(world, b, settings), "--stop-after-steps", "3"]
    assert cli_main(args) == 3
    assert not (b / "train").exists()

    # 2. a crash mid-epoch, two steps after the step-8 checkpoint
    class Crash(Exception):
        pass

    def crash(step):
        if step == 10:
            raise Crash

    with pytest.raises(Crash):
        run_train(world, b, settings, on_step=crash)
    assert not (b / "train").exists()

    # 3. resume to the end
    resumed = run_train(world, b, settings)
    assert resumed["resumed_from_step"] == 8 and resumed["steps"] == steps

    wa = load_file(str(tmp_path / "a" / "train" / "draft" / "model.safetensors"))
    wb = load_file(str(b / "train" / "draft" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    la = [
        json.loads(ln)["loss"]
        for ln in (tmp_path / "a" / "train" / "metrics.jsonl").read_text().splitlines()
    ]
    lb = [json.loads(ln)["loss"] for ln in (b / "train" / "metrics.jsonl").read_text().splitlines()]
    assert la == lb


def test_mismatching_shard_is_refused_before_training(world, tmp_path):
    meta = dict(world["meta"], aux_layer_ids=[1, 2, 3], tokenizer_hash="0123456789abcdef")
    bad = tmp_path / "bad.h5"
    write_shard(bad, world["model"], world["samples"][:2], ShardMeta(**meta), ["x:1", "x:2"])
    with pytest.raises(ShardError, match=r"bad\.h5: tokenizer_hash is '0123456789abcdef'"):
        run_train(world, tmp_path, train_settings(), [world["shards"][0], bad])
    assert not (tmp_path / "state").exists() and not (tmp_path / "train").exists()


def test_settings_errors_are_collected():
    with pytest.raises(EyrieError) as err:
        TrainSettings.from_settings({"train": {"epochs": "3", "draft_arch": "gpt2", "lr": 1}})
    msg = str(err.value)
    assert "train.lr: unknown key" in msg and "train.epochs: '3' is not of type 'integer'" in msg
    with pytest.raises(EyrieError, match=r"train.draft_arch: 'gpt2' is not one of \['llama', 'q"):
        TrainSettings.from_settings({"train": {"draft_arch": "gpt2"}})


def test_packs_per_step_must_be_positive():
    with pytest.raises(EyrieError, match="train.packs_per_step: 0 is less than the minimum of 1"):
        TrainSettings.from_settings({"train": {"packs_per_step": 0}})
    assert TrainSettings.from_settings({"train": {}}).packs_per_step == 1


def test_a_step_is_the_mean_over_consecutive_packs(world, tmp_path):
    from speculators.losses import resolve_loss_config

    from eyrie.arch.draft import DraftSpec, build_draft
    from eyrie.formats.report import shard_expectation
    from eyrie.formats.vocab import read_vocab

    data = PackedShards(
        world["shards"], shard_expectation(world["preflight"]), max_tokens=128, gap=2
    )
    packs = pack(data.lengths, epoch_order(len(data), 0, 0), 128, 2)
    P = next(p for p in (3, 4, 5) if len(packs) % p)  # a remainder to drop
    summary = run_train(world, tmp_path, train_settings(epochs=1, packs_per_step=P))
    assert summary["steps"] == len(packs) // P and summary["dropped_packs"] == len(packs) % P > 0
    assert (tmp_path / "state" / summary["run_id"] / VERIFIED_MARKER).is_file()

    # step 1 = the first P packs of the epoch's plan under the initial weights
    d2t, t2d = read_vocab(world["vocab"])
    model = build_draft(world["target"], DraftSpec(AUX_IDS, ttt_steps=3), d2t, t2d, seed=0)
    batches = [data.batch(p) for p in packs[:P]]
    losses = torch.stack(
        [
            model(**b, ttt_steps=3, loss_config=resolve_loss_config("kl_div", "eager"))[1]
            for b in batches
        ]
    )  # [P]
    losses.mean().backward()  # the step's gradient is the gradient of the mean loss
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    first = json.loads((tmp_path / "train" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(float(losses.detach().mean()), rel=1e-6)
    assert first["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    assert first["tokens"] == sum(int((b["document_ids"] >= 0).sum()) for b in batches)
    assert first["loss_tokens"] == sum(int(b["loss_mask"].sum()) for b in batches)
    data.close()


def shard_copy(world, tmp_path, i: int):
    bad = tmp_path / world["shards"][i].name
    shutil.copy(world["shards"][i], bad)
    return bad, [bad if j == i else s for j, s in enumerate(world["shards"])]


def refused_before_step_1(world, tmp_path, shards) -> str:
    """The ShardError message of a run on `shards` (into tmp_path), which took no step."""
    steps = []
    with pytest.raises(ShardError) as err:
        run_train(world, tmp_path, train_settings(), shards, on_step=steps.append)
    assert steps == []
    return str(err.value)


def test_truncated_shard_is_refused_before_the_first_step(world, tmp_path):
    bad, shards = shard_copy(world, tmp_path, 1)
    os.truncate(bad, bad.stat().st_size // 2)
    msg = refused_before_step_1(world, tmp_path, shards)
    assert "\n" not in msg and msg.startswith(f"{bad}: unreadable HDF5") and "truncated file" in msg
    assert f"to rebuild: delete {bad} and rerun snakemake (or: snakemake --force {bad})" in msg
    assert not (tmp_path / "state").exists() and not (tmp_path / "train").exists()


def test_corrupted_shard_values_are_refused_before_the_first_step(world, tmp_path):
    bad, shards = shard_copy(world, tmp_path, 0)
    with h5py.File(bad, "r") as f:
        start, size = f["aux_hidden"].id.get_offset(), f["aux_hidden"].id.get_storage_size()
    with bad.open("r+b") as fh:  # 32 bf16 values in the middle of the dataset become NaN patterns
        fh.seek(start + size // 2)
        fh.write(b"\xff" * 64)
    msg = refused_before_step_1(world, tmp_path, shards)
    assert "\n" not in msg and msg.startswith(f"{bad}: non-finite values in aux_hidden")
    assert f"delete {bad} and rerun snakemake" in msg
    assert not (tmp_path / "state").exists()
    # Without the scan the file opens; the bad sample fails only when training reads it.
    with pytest.raises(ShardError, match=r"sample \d+: non-finite values in aux_hidden"):
        run_train(world, tmp_path, train_settings(verify_shards=False), shards)


@pytest.mark.gpu
def test_a_draft_built_on_the_gpu_has_the_cpu_ones_verifier_rows(world):
    """build_draft(device=cuda) makes and initialises the parameters on the GPU (training's
    build; a CPU thread initialises a target-wide embedding slowly, twice): every tensor lands
    there, the verifier's rows (read on the CPU) equal a CPU build's, and the trainable layers
    are initialised (finite, not constant)."""
    from eyrie.arch.draft import DraftSpec, build_draft
    from eyrie.formats.vocab import read_vocab

    d2t, t2d = read_vocab(world["vocab"])
    spec = DraftSpec(AUX_IDS, ttt_steps=3)
    cpu = build_draft(world["target"], spec, d2t, t2d, seed=0)
    gpu = build_draft(world["target"], spec, d2t, t2d, seed=0, device="cuda").to("cuda")
    on_gpu = dict(gpu.state_dict())
    assert {t.device.type for t in on_gpu.values()} == {"cuda"}
    for name in ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"):
        assert torch.equal(on_gpu[name].cpu(), cpu.state_dict()[name]), name
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"):
        weight = on_gpu[name].float()
        assert torch.isfinite(weight).all() and weight.std() > 0, name
