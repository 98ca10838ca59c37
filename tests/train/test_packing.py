"""Packing and loading the shards: alignment, packs, the packed batch, float8 codes decoded on
the device, and the prefetching loader (eyrie/train/packing.py)."""

from __future__ import annotations

import pytest
import torch

from eyrie.core.errors import EyrieError, ShardError
from eyrie.formats.hidden import ShardMeta
from eyrie.train.packing import PackedShards, block_sample, epoch_order, pack, shift_sample
from tests.support.train_helpers import AUX_IDS, HIDDEN


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


def test_block_sample_keeps_each_token_with_its_own_states():
    """A block drafter's alignment (speculators trains DFlash and DSpark unshifted): position t
    holds x_t, its aux states g_t, its final state y_t (which predicts x_{t+1}) at position id t,
    and x_t's own mask. A block anchored at t then sees g_0..g_{t-1} as context, x_t in its
    first slot, and slot j's target y_{t+j-1}: the distribution of x_{t+j}, what decoding
    drafts there."""
    T, H = 7, 2
    x = torch.arange(100, 100 + T)
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 0], dtype=torch.bool)
    sample = {
        "input_ids": x,
        "loss_mask": mask,
        "aux_hidden": torch.arange(T).float()[:, None].repeat(1, 3 * H),  # g_t = t
        "final_hidden": 10 + torch.arange(T).float()[:, None].repeat(1, H),  # y_t = 10 + t
    }
    s = block_sample(sample)
    assert s["input_ids"].tolist() == x.tolist()
    assert s["hidden_states"][:, 0].tolist() == list(range(T))
    assert s["verifier_last_hidden_states"][:, 0].tolist() == [10.0 + t for t in range(T)]
    assert s["position_ids"].tolist() == list(range(T))
    assert s["loss_mask"].tolist() == mask.tolist()
    anchor, j = 3, 2  # slot j's target y_{anchor+j-1} predicts x_{anchor+j}; its mask is x's
    assert s["verifier_last_hidden_states"][anchor + j - 1, 0] == 10 + (anchor + j - 1)
    assert s["loss_mask"][anchor + j] == mask[anchor + j]


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


# ---------------------------------------------------------------- the prefetching loader


def _expect(world):
    from eyrie.formats.report import shard_expectation

    return shard_expectation(world["preflight"])


@pytest.mark.parametrize("shifted", [True, False])
def test_prefetcher_gives_the_synchronous_batches_and_token_counts(world, shifted):
    """For both alignments (EAGLE-3's shift, a block drafter's stored positions): the loader's
    batches are the synchronous ones, and the plan's token counts are the batch's."""
    from eyrie.train.packing import Prefetcher

    data = PackedShards(world["shards"], _expect(world), max_tokens=64, gap=2, shifted=shifted)
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
    short = PackedShards(world["shards"], _expect(world), 24, gap=2, shifted=shifted)  # truncates
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
