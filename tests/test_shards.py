"""The HDF5 hidden-state shard contract (eyrie/shards.py, docs/shard-format.md)."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
import torch

from eyrie.shards import (CHECKED_FIELDS, ShardError, ShardMeta, ShardReader, ShardWriter,
                          validate_shard)

H, N_AUX = 8, 3
LENGTHS = [5, 1, 7]


def meta(storage="bfloat16", **over) -> ShardMeta:
    fields = dict(target_fingerprint="abcdef0123456789", tokenizer_hash="0123456789abcdef",
                  aux_layer_ids=[1, 2, 3], final_layer_id=4, hidden_size=H,
                  storage_dtype=storage, producer={"settings": {"extract": {}}})
    fields.update(over)
    return ShardMeta(**fields)


def tokens(lengths=LENGTHS):
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 1000, n).tolist() for n in lengths]
    masks = [rng.integers(0, 2, n).tolist() for n in lengths]
    return [f"c.jsonl:{i + 1}" for i in range(len(lengths))], ids, masks


def random_bf16(shape, rng) -> torch.Tensor:
    """Random finite bf16 bit patterns, with -0.0, +0.0, subnormals and the largest values planted."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] &= 0xBFFF  # inf/nan exponent -> a large finite one
    flat = bits.reshape(-1)
    planted = [0x8000, 0x0000, 0x0001, 0x8001, 0x007F, 0x807F, 0x7F7F, 0xFF7F, 0x0080, 0x8080]
    n = min(len(planted), flat.size)
    flat[:n] = planted[:n]
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def write(path, storage="bfloat16", values=None, m=None):
    """Write a shard of LENGTHS samples; returns {i: (aux [T_i, N_AUX*H], final [T_i, H])}."""
    sids, ids, masks = tokens()
    rng = np.random.default_rng(1)
    values = values or {}
    with ShardWriter(path, m or meta(storage), sids, ids, masks) as w:
        for i in (2, 0, 1):  # out of order: offsets, not write order, place the rows
            if i not in values:
                if storage == "bfloat16":
                    values[i] = (random_bf16((LENGTHS[i], N_AUX * H), rng),
                                 random_bf16((LENGTHS[i], H), rng))
                else:
                    dt = getattr(torch, storage)
                    values[i] = (torch.from_numpy(rng.standard_normal((LENGTHS[i], N_AUX * H))).to(dt),
                                 torch.from_numpy(rng.standard_normal((LENGTHS[i], H))).to(dt))
            w.put(i, *values[i])
    return values


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_bf16_round_trip_is_bit_exact(tmp_path):
    path = tmp_path / "s.h5"
    values = write(path)
    with h5py.File(path, "r") as f:  # stored as the raw 16-bit pattern
        assert f["aux_hidden"].dtype == np.uint16 and f.attrs["storage_dtype"] == "bfloat16"
        first = f["aux_hidden"][f["offsets"][2]:f["offsets"][3]]
        assert np.array_equal(first, values[2][0].view(torch.int16).numpy().view(np.uint16))
    with ShardReader(path) as r:
        assert len(r) == 3 and list(r.lengths) == LENGTHS
        for i, (aux, final) in values.items():
            got = r.read(i)
            assert got["aux_hidden"].dtype == torch.bfloat16
            assert torch.equal(got["aux_hidden"].view(torch.int16), aux.view(torch.int16))
            assert torch.equal(got["final_hidden"].view(torch.int16), final.view(torch.int16))
    # -0.0 keeps its sign bit, subnormals survive
    neg_zero = values[2][0].reshape(-1)[0]
    assert neg_zero.view(torch.int16).item() == -32768 and neg_zero.item() == 0.0


@pytest.mark.parametrize("storage", ["float16", "float32"])
def test_float_round_trips(tmp_path, storage):
    path = tmp_path / "s.h5"
    values = write(path, storage)
    with ShardReader(path) as r:
        for i, (aux, final) in values.items():
            got = r.read(i)
            assert got["aux_hidden"].dtype == getattr(torch, storage)
            assert torch.equal(got["aux_hidden"], aux) and torch.equal(got["final_hidden"], final)


def test_bf16_storage_rounds_float32_input(tmp_path):
    x = torch.tensor([1.0 + 2 ** -9, -3.14159, 1e-40, 3e38]).repeat(LENGTHS[0], 2 * N_AUX)[:, : N_AUX * H]
    path = tmp_path / "s.h5"
    write(path, values={0: (x, x[:, :H])})
    with ShardReader(path) as r:
        assert torch.equal(r.read(0)["aux_hidden"], x.to(torch.bfloat16))


def test_one_sample_reads_without_the_others(tmp_path):
    path = tmp_path / "s.h5"
    sids, ids, masks = tokens()
    values = write(path)
    with h5py.File(path, "r+") as f:  # poison every row outside sample 1
        offsets = f["offsets"][:]
        assert list(offsets) == [0, 5, 6, 13]
        nan = np.uint16(0x7FC0)
        for name in ("aux_hidden", "final_hidden"):
            f[name][: offsets[1]] = nan
            f[name][offsets[2]:] = nan
    with ShardReader(path) as r:
        got = r.read(1)
        assert r.sample_ids() == sids
        assert got["input_ids"].tolist() == ids[1] and got["loss_mask"].tolist() == [bool(m) for m in masks[1]]
        assert torch.equal(got["aux_hidden"].view(torch.int16), values[1][0].view(torch.int16))
        with pytest.raises(ShardError, match=r"sample 0: non-finite values in aux_hidden"):
            r.read(0)
    with pytest.raises(ShardError, match="non-finite values in aux_hidden"):
        validate_shard(path)


@pytest.mark.parametrize("field", CHECKED_FIELDS)
def test_reader_refuses_other_expectations(tmp_path, field):
    path = tmp_path / "s.h5"
    write(path)
    good = {k: getattr(meta(), k) for k in CHECKED_FIELDS}
    with ShardReader(path, expect=good):
        pass
    wrong = {"target_fingerprint": "ffffffffffffffff", "tokenizer_hash": "eeeeeeeeeeeeeeee",
             "aux_layer_ids": [1, 2, 5], "final_layer_id": 61, "hidden_size": 7168}[field]
    with pytest.raises(ShardError) as err:
        ShardReader(path, expect={**good, field: wrong})
    assert f"{path}: {field} is " in str(err.value) and repr(wrong) in str(err.value)


@pytest.mark.parametrize("damage", ["truncate-10", "truncate-50", "truncate-95", "superblock",
                                    "not-hdf5", "missing"])
def test_damaged_file_names_the_file(tmp_path, damage):
    good, path = tmp_path / "good.h5", tmp_path / "bad.h5"
    write(good)
    data = good.read_bytes()
    if damage.startswith("truncate"):
        path.write_bytes(data[: len(data) * int(damage.split("-")[1]) // 100])
    elif damage == "superblock":
        path.write_bytes(data[:8] + b"\xff" * 64 + data[72:])
    elif damage == "not-hdf5":
        path.write_text("{}")
    with pytest.raises(ShardError, match=str(path)):
        with ShardReader(path) as r:
            for i in range(len(r)):
                r.read(i)
    with pytest.raises(ShardError, match=str(path)):
        validate_shard(path)


@pytest.mark.parametrize("dataset", ["final_hidden", "offsets", "loss_mask"])
def test_missing_dataset_is_named(tmp_path, dataset):
    path = tmp_path / "s.h5"
    write(path)
    with h5py.File(path, "r+") as f:
        del f[dataset]
    for check in (ShardReader, validate_shard):
        with pytest.raises(ShardError, match=f"{path}: dataset '{dataset}' missing"):
            check(path)


def test_missing_or_foreign_attrs_are_refused(tmp_path):
    path = tmp_path / "s.h5"
    write(path)
    with h5py.File(path, "r+") as f:
        del f.attrs["hidden_size"]
    with pytest.raises(ShardError, match=f"{path}: attr 'hidden_size' missing"):
        ShardReader(path)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(ShardError, match=f"{other}: not an eyrie hidden-state shard"):
        ShardReader(other)


def test_exception_inside_writer_leaves_nothing(tmp_path):
    sids, ids, masks = tokens()
    path = tmp_path / "out" / "s.h5"
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(path, meta(), sids, ids, masks) as w:
            w.put(0, torch.zeros(5, N_AUX * H), torch.zeros(5, H))
            raise RuntimeError("boom")
    assert leftovers(path.parent) == []


def test_sample_never_written_leaves_nothing(tmp_path):
    sids, ids, masks = tokens()
    path = tmp_path / "s.h5"
    with pytest.raises(ShardError, match=r"1 samples never written \(first: index 1\)"):
        with ShardWriter(path, meta(), sids, ids, masks) as w:
            w.put(0, torch.zeros(5, N_AUX * H), torch.zeros(5, H))
            w.put(2, torch.zeros(7, N_AUX * H), torch.zeros(7, H))
    assert leftovers(tmp_path) == []


def test_failed_rewrite_keeps_the_previous_complete_file(tmp_path):
    path = tmp_path / "s.h5"
    values = write(path)
    before = path.read_bytes()
    sids, ids, masks = tokens()
    with pytest.raises(ShardError, match="never written"):
        with ShardWriter(path, meta(), sids, ids, masks):
            pass
    assert path.read_bytes() == before and leftovers(tmp_path) == ["s.h5"]
    with ShardReader(path) as r:
        assert torch.equal(r.read(0)["final_hidden"].view(torch.int16), values[0][1].view(torch.int16))


@pytest.mark.parametrize("storage,bad", [("bfloat16", float("nan")), ("bfloat16", float("inf")),
                                         ("float32", float("-inf")), ("float16", 1e6)])
def test_non_finite_values_are_refused(tmp_path, storage, bad):
    sids, ids, masks = tokens()
    path = tmp_path / "s.h5"
    aux = torch.zeros(5, N_AUX * H)
    aux[3, 17] = bad  # 1e6 is finite in float32 but overflows float16 storage
    with pytest.raises(ShardError, match=r"sample 0: non-finite aux_hidden"):
        with ShardWriter(path, meta(storage), sids, ids, masks) as w:
            w.put(0, aux, torch.zeros(5, H))
    assert leftovers(tmp_path) == []


def test_shape_mismatch_gives_both_shapes(tmp_path):
    sids, ids, masks = tokens()
    with pytest.raises(ShardError, match=r"got aux \(5, 24\) final \(5, 9\), expected \(5, 24\) and \(5, 8\)"):
        with ShardWriter(tmp_path / "s.h5", meta(), sids, ids, masks) as w:
            w.put(0, torch.zeros(5, N_AUX * H), torch.zeros(5, H + 1))
    assert leftovers(tmp_path) == []


def test_writer_checks_ids_against_tokenized_shard(tmp_path):
    # a shard copied over with another tokenization would be refused by validate_shard
    path = tmp_path / "s.h5"
    write(path)
    sids, ids, masks = tokens()
    validate_shard(path, expected_ids=np.concatenate([np.asarray(x, np.int32) for x in ids]))
    other = np.concatenate([np.asarray(x, np.int32) for x in ids]) + 1
    with pytest.raises(ShardError, match="input_ids differ from the tokenized shard"):
        validate_shard(path, expected_ids=other)
    shutil.copy(path, tmp_path / "copy.h5")
    assert validate_shard(tmp_path / "copy.h5").aux_layer_ids == [1, 2, 3]


def test_empty_shard_round_trips(tmp_path):
    path = tmp_path / "s.h5"
    with ShardWriter(path, meta(), [], [], []):
        pass
    with ShardReader(path) as r:
        assert len(r) == 0 and r.sample_ids() == []
