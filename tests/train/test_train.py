"""Draft training: alignment, packing, forward/backward, loss falls, exact resume, shard checks."""

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
from eyrie.train.packing import PackedShards, epoch_order, pack, shift_sample
from eyrie.train.recipe import VERIFIED_MARKER, TrainPaths, train
from tests.support.train_helpers import (
    AUX_IDS,
    HIDDEN,
    build_world,
    train_paths,
    train_settings,
    write_shard,
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("world"))


def run_train(world, root, settings, **kw):
    return train(
        train_paths(world, root),
        settings,
        **kw,
    )


def test_shift_sample_aligns_mask_with_the_predicted_token():
    T, H = 7, 2
    x = torch.arange(100, 100 + T)  # token ids x_t = 100 + t
    sample = {
        "input_ids": x,
        "loss_mask": torch.tensor([0, 0, 0, 1, 1, 1, 0], dtype=torch.bool),
        "aux_hidden": torch.arange(T).float()[:, None].repeat(1, 3 * H),  # g_t = t
        "final_hidden": 10 + torch.arange(T).float()[:, None].repeat(1, H),  # y_t = 10 + t
    }
    s = shift_sample(sample)
    assert s["input_ids"].tolist() == list(range(101, 100 + T))
    assert s["hidden_states"][:, 0].tolist() == list(range(0, T - 1))
    assert s["verifier_last_hidden_states"][:, 0].tolist() == [10.0 + t for t in range(1, T)]
    assert s["position_ids"].tolist() == list(range(1, T))
    # y_{j+1} predicts x_{j+2}: the mask is that token's, loss_mask[j+2], 0 at the end.
    assert s["loss_mask"].tolist() == [False, True, True, True, False, False]
    predicted = x[2:].tolist() + [None]
    masked = [predicted[j] for j in range(T - 1) if s["loss_mask"][j]]
    assert masked == [x[t].item() for t in range(T) if sample["loss_mask"][t]]


def test_pack_respects_the_budget_and_truncates_long_samples():
    lengths = [10, 50, 200, 5, 30]
    batches = pack(lengths, [4, 3, 2, 1, 0], max_tokens=64, gap=2)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]
    for b in batches:
        assert sum(min(lengths[i], 62) + 2 for i in b) <= 64
    assert [2] in batches  # the long sample alone, truncated to 62 tokens + gap


def test_packed_batch_layout(world):
    expect = {
        "target_fingerprint": world["meta"]["target_fingerprint"],
        "tokenizer_hash": world["meta"]["tokenizer_hash"],
        "aux_layer_ids": AUX_IDS,
        "final_layer_id": 4,
        "hidden_size": HIDDEN,
    }
    data = PackedShards(world["shards"], expect, max_tokens=40, gap=2)
    long = max(range(len(data)), key=lambda i: data.lengths[i])
    assert data.lengths[long] > 38
    batch = data.batch([0, long])
    n0 = data.lengths[0]
    doc = batch["document_ids"][0].tolist()
    assert doc == [0] * n0 + [-1, -1] + [1] * 38 + [-1, -1]
    assert batch["hidden_states"].shape == (1, len(doc), 3 * HIDDEN)
    assert batch["hidden_states"].dtype == torch.float32
    assert batch["verifier_last_hidden_states"].shape == (1, len(doc), HIDDEN)
    assert not batch["loss_mask"][0][torch.tensor(doc) < 0].any()
    assert batch["position_ids"][0, :n0].tolist() == list(range(1, n0 + 1))
    data.close()


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


def test_float8_codes_decoded_on_the_device_equal_the_host_dequantized_batch(world, tmp_path):
    """float8_e4m3 shards travel to the GPU as codes + per-token scales (transfer_dtype uint8,
    a quarter of float32's bytes, nothing dequantized on the host) and decode_batch there gives
    the float32 batch that host dequantizing gives, bit for bit (padding and gaps included)."""
    from eyrie.train.packing import decode_batch
    from tests.support.train_helpers import write_shard

    meta = ShardMeta(**{**world["meta"], "storage_dtype": "float8_e4m3"})
    paths = []
    for s in range(2):
        part = world["samples"][s::2]
        paths.append(tmp_path / f"fp8_{s}.h5")
        write_shard(paths[-1], world["model"], part, meta, [f"c:{s}:{i}" for i in range(len(part))])
    data = PackedShards(paths, _expect(world), max_tokens=96, gap=2)
    assert data.transfer_dtype == torch.uint8
    for p in pack(data.lengths, epoch_order(len(data), 0, 0), 96, 2)[:4]:
        want = data.batch(p, pad_to=96)
        raw = data.batch(p, torch.uint8, pad_to=96)
        assert raw["hidden_states"].dtype == torch.uint8
        assert raw["hidden_states"].nbytes * 4 == want["hidden_states"].nbytes
        got = decode_batch(raw)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    data.close()
    with pytest.raises(EyrieError, match="needs every shard stored as float8_e4m3"):
        PackedShards(world["shards"], _expect(world), max_tokens=96, gap=2).batch([0], torch.uint8)


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
    args = [
        "train",
        "--target",
        str(world["target"]),
        "--preflight",
        str(world["preflight"]),
        "--vocab",
        str(world["vocab"]),
        "--shards",
        *map(str, world["shards"]),
        "--out-dir",
        str(b / "train"),
        "--state-dir",
        str(b / "state"),
        "--settings",
        json.dumps(settings),
        "--stop-after-steps",
        "3",
    ]
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
        train(
            TrainPaths(
                world["target"],
                world["preflight"],
                world["vocab"],
                [world["shards"][0], bad],
                tmp_path / "train",
                tmp_path / "state",
            ),
            train_settings(),
        )
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


def test_truncated_shard_is_refused_before_the_first_step(world, tmp_path):
    bad, shards = shard_copy(world, tmp_path, 1)
    os.truncate(bad, bad.stat().st_size // 2)
    steps = []
    with pytest.raises(ShardError) as err:
        train(
            TrainPaths(
                world["target"],
                world["preflight"],
                world["vocab"],
                shards,
                tmp_path / "train",
                tmp_path / "state",
            ),
            train_settings(),
            on_step=steps.append,
        )
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{bad}: unreadable HDF5") and "truncated file" in msg
    assert f"to rebuild: delete {bad} and rerun snakemake (or: snakemake --force {bad})" in msg
    assert steps == [] and not (tmp_path / "state").exists() and not (tmp_path / "train").exists()


def test_corrupted_shard_values_are_refused_before_the_first_step(world, tmp_path):
    bad, shards = shard_copy(world, tmp_path, 0)
    with h5py.File(bad, "r") as f:
        start, size = f["aux_hidden"].id.get_offset(), f["aux_hidden"].id.get_storage_size()
    with bad.open("r+b") as fh:  # 32 bf16 values in the middle of the dataset become NaN patterns
        fh.seek(start + size // 2)
        fh.write(b"\xff" * 64)
    steps = []
    with pytest.raises(ShardError) as err:
        train(
            TrainPaths(
                world["target"],
                world["preflight"],
                world["vocab"],
                shards,
                tmp_path / "train",
                tmp_path / "state",
            ),
            train_settings(),
            on_step=steps.append,
        )
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{bad}: non-finite values in aux_hidden")
    assert f"delete {bad} and rerun snakemake" in msg
    assert steps == [] and not (tmp_path / "state").exists()
    # Without the scan the file opens; the bad sample fails only when training reads it.
    with pytest.raises(ShardError, match=r"sample \d+: non-finite values in aux_hidden"):
        train(
            TrainPaths(
                world["target"],
                world["preflight"],
                world["vocab"],
                shards,
                tmp_path / "train",
                tmp_path / "state",
            ),
            train_settings(verify_shards=False),
        )


# ---------------------------------------------------------------- the prefetching loader


def _expect(world):
    from eyrie.formats.report import shard_expectation

    return shard_expectation(world["preflight"])


def test_prefetcher_gives_the_synchronous_batches_and_token_counts(world):
    from eyrie.train.packing import Prefetcher

    data = PackedShards(world["shards"], _expect(world), max_tokens=64, gap=2)
    packs = pack(data.lengths, epoch_order(len(data), 0, 0), 64, 2)
    steps = [packs[i : i + 2] for i in range(0, len(packs) - 1, 2)]
    assert len(steps) >= 3 and data.transfer_dtype == torch.bfloat16  # the world's shards: bf16
    with Prefetcher(data, steps, depth=1) as loader:
        for step in steps:
            got = loader.get()
            assert len(got) == len(step)
            for batch, p in zip(got, step):
                want = data.batch(p)
                assert batch.keys() == want.keys()
                for k in want:
                    assert batch[k].dtype == want[k].dtype and torch.equal(batch[k], want[k]), k
                assert data.tokens(p) == (
                    int((want["document_ids"] >= 0).sum()),
                    int(want["loss_mask"].sum()),
                )
                # stored dtype on the way, widened later: the same float32 values
                narrow = data.batch(p, data.transfer_dtype)
                assert narrow["hidden_states"].dtype == torch.bfloat16
                assert torch.equal(narrow["hidden_states"].float(), want["hidden_states"])
        with pytest.raises(StopIteration):
            loader.get()
    data.close()
    short = PackedShards(world["shards"], _expect(world), max_tokens=24, gap=2)  # truncates
    assert short.truncated > 0
    for i in range(len(short)):
        b = short.batch([i])
        assert short.tokens([i]) == (int((b["document_ids"] >= 0).sum()), int(b["loss_mask"].sum()))
    short.close()


def test_prefetcher_raises_the_thread_error_with_its_traceback_and_stops(world):
    import threading
    import traceback

    from eyrie.train.packing import Prefetcher

    class Boom(ShardError):
        pass

    class Failing(PackedShards):
        def batch(self, indices, dtype=torch.float32, pin=False, pad_to=None):
            if indices == [2]:
                raise Boom("shard x.h5: sample 2 unreadable")
            return super().batch(indices, dtype, pin, pad_to)

    data = Failing(world["shards"], _expect(world), max_tokens=64, gap=2)
    loader = Prefetcher(data, [[[0]], [[1]], [[2]], [[3]]])
    assert len(loader.get()) == 1 and len(loader.get()) == 1
    with pytest.raises(Boom, match="sample 2 unreadable") as err:
        loader.get()
    frames = [f.name for f in traceback.extract_tb(err.value.__traceback__)]
    assert "_run" in frames and "batch" in frames  # where the thread raised it
    assert not any(t.name == "eyrie-prefetch" and t.is_alive() for t in threading.enumerate())
    data.close()


def test_prefetcher_close_stops_a_thread_waiting_on_a_full_queue(world):
    from eyrie.train.packing import Prefetcher

    data = PackedShards(world["shards"], _expect(world), max_tokens=64, gap=2)
    loader = Prefetcher(data, [[[i]] for i in range(len(data))], depth=1)
    loader.get()
    loader.close()  # the thread is blocked putting the next step
    assert not loader._thread.is_alive()
    data.close()
