"""The HDF5 hidden-state shard contract (eyrie.formats.hidden and codecs, docs/shard-format.md)."""

from __future__ import annotations

import ctypes
import errno
import gc
import json
import os
import shutil
import time

import h5py
import numpy as np
import pytest
import torch

from eyrie.core.errors import ShardError
from eyrie.formats import hidden as shards
from eyrie.formats import hidden_writer
from eyrie.formats import pagecache as shards_pagecache
from eyrie.formats.codecs import bytes_per_token, quantize_e4m3, stored_arrays
from eyrie.formats.hidden import (
    CHECKED_FIELDS,
    ShardMeta,
    ShardReader,
    validate_shard,
)
from eyrie.formats.hidden_writer import ShardWriter
from eyrie.train.packing import PackedShards

H, N_AUX = 8, 3
LENGTHS = [5, 1, 7]


def meta(storage="bfloat16", **over) -> ShardMeta:
    fields = dict(
        target_fingerprint="abcdef0123456789",
        tokenizer_hash="0123456789abcdef",
        aux_layer_ids=[1, 2, 3],
        final_layer_id=4,
        hidden_size=H,
        storage_dtype=storage,
        producer={"settings": {"extract": {}}},
    )
    fields.update(over)
    return ShardMeta(**fields)


def tokens(lengths=LENGTHS):
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 1000, n).tolist() for n in lengths]
    masks = [rng.integers(0, 2, n).tolist() for n in lengths]
    return [f"c.jsonl:{i + 1}" for i in range(len(lengths))], ids, masks


def random_bf16(shape, rng) -> torch.Tensor:
    """Random finite bf16 bit patterns, with -0.0, +0.0, subnormals and the largest values
    planted."""
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
                    values[i] = (
                        random_bf16((LENGTHS[i], N_AUX * H), rng),
                        random_bf16((LENGTHS[i], H), rng),
                    )
                else:  # float8_e4m3 is quantized from float32 by put
                    dt = torch.float32 if storage == "float8_e4m3" else getattr(torch, storage)
                    values[i] = (
                        torch.from_numpy(rng.standard_normal((LENGTHS[i], N_AUX * H))).to(dt),
                        torch.from_numpy(rng.standard_normal((LENGTHS[i], H))).to(dt),
                    )
            w.put(i, *values[i])
    return values


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_bf16_round_trip_is_bit_exact(tmp_path):
    path = tmp_path / "s.h5"
    values = write(path)
    with h5py.File(path, "r") as f:  # stored as the raw 16-bit pattern
        assert f["aux_hidden"].dtype == np.uint16 and f.attrs["storage_dtype"] == "bfloat16"
        first = f["aux_hidden"][f["offsets"][2] : f["offsets"][3]]
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
    x = torch.tensor([1.0 + 2**-9, -3.14159, 1e-40, 3e38]).repeat(LENGTHS[0], 2 * N_AUX)[
        :, : N_AUX * H
    ]
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
            f[name][offsets[2] :] = nan
    with ShardReader(path) as r:
        got = r.read(1)
        assert r.sample_ids() == sids
        assert got["input_ids"].tolist() == ids[1] and got["loss_mask"].tolist() == [
            bool(m) for m in masks[1]
        ]
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
    wrong = {
        "target_fingerprint": "ffffffffffffffff",
        "tokenizer_hash": "eeeeeeeeeeeeeeee",
        "aux_layer_ids": [1, 2, 5],
        "final_layer_id": 61,
        "hidden_size": 7168,
    }[field]
    with pytest.raises(ShardError) as err:
        ShardReader(path, expect={**good, field: wrong})
    assert f"{path}: {field} is " in str(err.value) and repr(wrong) in str(err.value)


@pytest.mark.parametrize(
    "damage", ["truncate-10", "truncate-50", "truncate-95", "superblock", "not-hdf5", "missing"]
)
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


def test_a_shard_says_what_its_layer_ids_and_final_state_are(tmp_path):
    """Written into every shard: vLLM's layer-id convention and the final state before the norm
    (what a reader would otherwise guess); absent (a shard from before) reads the same, another
    meaning is refused in one line naming the shard."""
    from eyrie.formats.hidden import CONVENTIONS

    path = tmp_path / "s.h5"
    write(path)
    with h5py.File(path, "r") as f:
        assert {k: str(f.attrs[k]) for k in CONVENTIONS} == CONVENTIONS
        assert "vllm" in CONVENTIONS["layer_ids"] and "before the final norm" in str(
            f.attrs["final_state"]
        )
    with h5py.File(path, "r+") as f:
        del f.attrs["layer_ids"], f.attrs["final_state"]
    ShardReader(path).close()
    with h5py.File(path, "r+") as f:
        f.attrs["final_state"] = "after the final norm"
    with pytest.raises(ShardError, match=f"{path}: attr 'final_state' is 'after the final norm'"):
        ShardReader(path)


def test_exception_inside_writer_leaves_nothing(tmp_path):
    sids, ids, masks = tokens()
    path = tmp_path / "out" / "s.h5"
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(path, meta(), sids, ids, masks) as w:
            w.put(0, torch.zeros(5, N_AUX * H), torch.zeros(5, H))
            raise RuntimeError("boom")
    assert leftovers(path.parent) == []


@pytest.mark.slow
def test_closes_while_another_thread_starts_subprocesses(tmp_path):
    """A subprocess started by another thread (the engine's next shard, while this one closes
    behind it) holds a copy of the shard's descriptor for a moment: with HDF5's file locks on,
    the writer's validation of its own file failed with EAGAIN (with them on, 300 closes of
    this test failed in 2 runs of 3; it makes 600)."""
    import subprocess
    import threading

    stop, spawned = threading.Event(), []

    def spawn():
        while not stop.is_set():
            subprocess.run(["true"])
            spawned.append(1)

    spawner = threading.Thread(target=spawn)
    spawner.start()
    sids, ids, masks = tokens()
    try:
        for k in range(600):
            path = tmp_path / f"s{k}.h5"
            with ShardWriter(path, meta(), sids, ids, masks) as w:
                for i, n in enumerate(LENGTHS):
                    w.put(i, torch.zeros(n, N_AUX * H), torch.zeros(n, H))
            path.unlink()
    finally:
        stop.set()
        spawner.join()
    assert len(spawned) > 100  # the closes did overlap the subprocesses


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
        assert torch.equal(
            r.read(0)["final_hidden"].view(torch.int16), values[0][1].view(torch.int16)
        )


@pytest.mark.parametrize(
    "storage,bad",
    [
        ("bfloat16", float("nan")),
        ("bfloat16", float("inf")),
        ("float32", float("-inf")),
        ("float16", 1e6),
        ("float8_e4m3", float("nan")),
        ("float8_e4m3", float("-inf")),
    ],
)
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
    with pytest.raises(
        ShardError, match=r"got aux \(5, 24\) final \(5, 9\), expected \(5, 24\) and \(5, 8\)"
    ):
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


# ----------------------------------------------------------------------------- read path

STORAGES = ["bfloat16", "float16", "float32", "float8_e4m3"]


def raw_hidden(path, i: int) -> dict[str, np.ndarray]:
    """Sample i's stored hidden rows (and scales), read by h5py."""
    with h5py.File(path, "r") as f:
        a, b = f["offsets"][i], f["offsets"][i + 1]
        return {
            k: f[k][a:b]
            for k in ("aux_hidden", "final_hidden", "aux_scale", "final_scale")
            if k in f
        }


@pytest.mark.parametrize("storage", STORAGES)
def test_writer_layout_is_contiguous_and_read_by_offset(tmp_path, storage):
    path = tmp_path / "s.h5"
    write(path, storage)
    with h5py.File(path, "r") as f:
        for name in ("aux_hidden", "final_hidden") + (
            ("aux_scale", "final_scale") if storage == "float8_e4m3" else ()
        ):
            ds = f[name]
            assert ds.chunks is None and ds.compression is None and ds.id.get_offset() is not None
    with ShardReader(path) as r:  # hidden states mapped, the small datasets read by pread
        assert r.access == {n: "mmap" if n.endswith("hidden") else "pread" for n in r.access}


def write_from_files(path, tmp_path, storage, values):
    """Write the shard of `values` {i: (aux, final)} by put_from_file: each sample's stored
    bytes lie in a source file of their own, after a few bytes of something else."""
    sids, ids, masks = tokens()
    fds = []
    try:
        with ShardWriter(path, meta(storage), sids, ids, masks) as w:
            for i in (2, 0, 1):
                src = tmp_path / f"src{i}"
                with open(src, "wb") as f:
                    f.write(b"head")
                    sources = {}
                    for name, x in stored_arrays(*values[i], storage).items():
                        sources[name] = (f.tell(), x.nbytes)
                        f.write(x.tobytes())
                fds.append(os.open(src, os.O_RDONLY))
                w.put_from_file(i, {n: (fds[-1], at, nb) for n, (at, nb) in sources.items()})
    finally:
        for fd in fds:
            os.close(fd)


def hidden_values(storage, rng) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {
        i: (
            torch.from_numpy(rng.standard_normal((T, N_AUX * H))).to(torch.bfloat16),
            torch.from_numpy(rng.standard_normal((T, H))).to(torch.bfloat16),
        )
        for i, T in enumerate(LENGTHS)
    }


def assert_reads(path, values, storage):
    """The shard at `path` is complete and holds the stored bytes of `values`, scales too."""
    ShardReader(path).close()
    with h5py.File(path, "r") as f:
        for i, (aux, final) in values.items():
            a, b = f["offsets"][i], f["offsets"][i + 1]
            for name, x in stored_arrays(aux, final, storage).items():
                assert f[name][a:b].tobytes() == x.tobytes(), (i, name)


@pytest.fixture
def writeback_calls(monkeypatch):
    """Every write-back the writer starts and waits for: [(start|wait, fd, offset, bytes)]."""
    calls = []

    def recorded(kind, real):
        def call(fd, at, nbytes):
            calls.append((kind, fd, at, nbytes))
            return real(fd, at, nbytes)

        return call

    monkeypatch.setattr(
        hidden_writer, "start_writeback", recorded("start", hidden_writer.start_writeback)
    )
    monkeypatch.setattr(
        hidden_writer, "wait_writeback", recorded("wait", hidden_writer.wait_writeback)
    )
    return calls


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3"])
@pytest.mark.parametrize("how", ["put", "put_from_file"])
def test_writeback_is_started_for_every_byte_of_the_hidden_datasets(
    tmp_path, writeback_calls, storage, how
):
    """Each range put_stored or put_from_file writes has its write-back started at once, and
    together those ranges are exactly the bytes of the hidden datasets (and scales)."""
    path = tmp_path / "s.h5"
    values = hidden_values(storage, np.random.default_rng(3))
    if how == "put":
        write(path, storage, values=dict(values))
    else:
        write_from_files(path, tmp_path, storage, values)
    assert_reads(path, values, storage)
    started = sorted((at, at + n) for kind, _, at, n in writeback_calls if kind == "start")
    with h5py.File(path, "r") as f:
        names = [n for n in ("aux_hidden", "final_hidden", "aux_scale", "final_scale") if n in f]
        datasets = sorted(
            (f[n].id.get_offset(), f[n].id.get_offset() + f[n].id.get_storage_size()) for n in names
        )
    covered, end = [], None
    for a, b in started:  # merge the touching ranges; none may overlap another
        assert end is None or a >= end, (a, end)
        if covered and a == covered[-1][1]:
            covered[-1] = (covered[-1][0], b)
        else:
            covered.append((a, b))
        end = b
    merged = []
    for a, b in datasets:
        if merged and a == merged[-1][1]:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    assert covered == merged


def test_writeback_waits_for_the_oldest_ranges_past_its_bound(
    tmp_path, writeback_calls, monkeypatch
):
    """With WRITEBACK_AHEAD 0 every range is waited for right after its write-back starts, on
    the range and descriptor it was started on; the shard is the same."""
    monkeypatch.setattr(hidden_writer, "WRITEBACK_AHEAD", 0)
    values = write(tmp_path / "s.h5")
    assert_reads(tmp_path / "s.h5", values, "bfloat16")
    kinds = [c[0] for c in writeback_calls]
    assert kinds == ["start", "wait"] * (len(kinds) // 2) and kinds
    assert writeback_calls[0::2] == [("start", *c[1:]) for c in writeback_calls[1::2]]


def failing_sync_file_range(err):
    def call(fd, offset, nbytes, flags):
        ctypes.set_errno(err)
        return -1

    return call


@pytest.mark.parametrize("err", [errno.ESPIPE, errno.EINVAL, errno.ENOSYS, None])
def test_writeback_refused_or_unavailable_changes_nothing(tmp_path, monkeypatch, err):
    """A filesystem that refuses write-back on request (or no sync_file_range at all): the
    shard is written, fsynced and renamed as without it."""
    call = None if err is None else failing_sync_file_range(err)
    monkeypatch.setattr(shards_pagecache, "_SYNC_FILE_RANGE", call)
    monkeypatch.setattr(hidden_writer, "WRITEBACK_AHEAD", 0)  # the waits too
    path = tmp_path / "s.h5"
    values = write(path)
    assert_reads(path, values, "bfloat16")
    assert leftovers(tmp_path) == ["s.h5"]
    values = hidden_values("bfloat16", np.random.default_rng(4))
    write_from_files(path, tmp_path, "bfloat16", values)
    assert_reads(path, values, "bfloat16")


def test_a_failed_writeback_fails_the_shard(tmp_path, monkeypatch):
    """A write error seen by the write-back (EIO) is raised, not ignored (a wait that saw it
    would hide it from the fsync): nothing appears at the shard's path."""
    monkeypatch.setattr(shards_pagecache, "_SYNC_FILE_RANGE", failing_sync_file_range(errno.EIO))
    with pytest.raises(OSError, match="write-back of"):
        write(tmp_path / "s.h5")
    assert leftovers(tmp_path) == []


@pytest.mark.skipif(shards_pagecache._SYNC_FILE_RANGE is None, reason="no sync_file_range")
def test_writeback_through_libc(tmp_path):
    """The real call: started and waited for on a file, refused (ESPIPE) on a pipe."""
    with open(tmp_path / "f", "wb") as f:
        f.write(b"x" * 8192)
        f.flush()
        assert shards_pagecache.start_writeback(f.fileno(), 0, 8192)
        shards_pagecache.wait_writeback(f.fileno(), 0, 8192)
    r, w = os.pipe()
    try:
        assert not shards_pagecache.start_writeback(w, 0, 1)
    finally:
        os.close(r)
        os.close(w)


def test_the_shard_is_fsynced_before_its_rename_and_its_folder_after(tmp_path, monkeypatch):
    """Write-back during the write leaves the close as it was: the fsync before the rename."""
    path = tmp_path / "s.h5"
    calls, real = [], os.fsync

    def fsync(fd):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), path.exists()))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write(path)
    assert calls == [(str(tmp_path / f".s.h5.tmp-{os.getpid()}"), False), (str(tmp_path), True)]


@pytest.fixture
def map_all(monkeypatch):
    """Map every hidden-state read (the tiny test samples are below the size that is mapped)."""
    monkeypatch.setattr(shards, "MAP_MIN_BYTES", 0)


def test_returned_tensors_are_private_and_outlive_the_reader(tmp_path, map_all):
    path = tmp_path / "s.h5"
    values = write(path)
    before = path.read_bytes()
    with ShardReader(path, check_values=False) as r:
        got = r.read(2)["aux_hidden"]
        got[0, 0] = 7.0  # copy-on-write: neither the file nor the next read sees it
        assert r.read(2)["aux_hidden"][0, 0].view(torch.int16) == values[2][0][0, 0].view(
            torch.int16
        )
    assert path.read_bytes() == before
    assert got[0, 0] == 7.0 and torch.equal(
        got[1:].view(torch.int16), values[2][0][1:].view(torch.int16)
    )
    assert maps_of(path) == 1  # the tensor's own map, kept after close
    del got
    gc.collect()
    assert maps_of(path) == 0  # unmapped once freed


def maps_of(path) -> int:
    """Memory maps of `path` in this process."""
    with open("/proc/self/maps") as f:
        return sum(line.rstrip().endswith(str(path)) for line in f)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("layout", ["chunked-gzip", "no-mmap"])
def test_other_layouts_read_the_same(tmp_path, monkeypatch, storage, layout):
    """A repacked (chunked, compressed) shard reads through h5py; without a memory map the
    offsets are read by pread. Same values as mapped reads."""
    path = tmp_path / "s.h5"
    write(path, storage)
    with monkeypatch.context() as m:
        m.setattr(shards, "MAP_MIN_BYTES", 0)
        with ShardReader(path) as r:
            want = [{k: v.clone() for k, v in r.read(i).items()} for i in range(len(r))]
    if layout == "chunked-gzip":
        with h5py.File(path, "r+") as f:
            for name in [k for k in f if k not in ("offsets", "sample_ids")]:
                data = f[name][:]
                del f[name]
                f.create_dataset(name, data=data, chunks=True, compression="gzip")
        mode = "h5py"
    else:
        monkeypatch.setattr(shards, "_LIBC", None)
        mode = "pread"
    with ShardReader(path) as r:
        assert set(r.access.values()) == {mode}, r.access
        for i in range(len(r)):
            got = r.read(i)
            for k, v in want[i].items():
                assert got[k].dtype == v.dtype and torch.equal(
                    got[k].view(torch.int16) if v.dtype == torch.bfloat16 else got[k],
                    v.view(torch.int16) if v.dtype == torch.bfloat16 else v,
                ), k
    validate_shard(path)


def poison(path, name: str, row: int, pattern: bytes) -> None:
    """Overwrite the first value of one row of a dataset in the file."""
    with h5py.File(path, "r") as f:
        ds = f[name]
        at = ds.id.get_offset() + row * ds.dtype.itemsize * int(np.prod(ds.shape[1:]))
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(pattern)


@pytest.mark.parametrize("mapped", [True, False])
@pytest.mark.parametrize(
    "storage,name,pattern",
    [
        ("bfloat16", "final_hidden", b"\x80\x7f"),  # +inf
        ("float16", "aux_hidden", b"\x01\x7e"),  # NaN
        ("float32", "aux_hidden", b"\x00\x00\xc0\xff"),  # NaN
        ("float8_e4m3", "aux_hidden", b"\x7f"),  # e4m3fn NaN code
        ("float8_e4m3", "final_scale", np.float32(0).tobytes()),  # a zero scale
        ("float8_e4m3", "aux_scale", np.float32("inf").tobytes()),
    ],
)
def test_checked_reads_and_the_scan_refuse_bad_values(
    tmp_path, monkeypatch, mapped, storage, name, pattern
):
    if mapped:
        monkeypatch.setattr(shards, "MAP_MIN_BYTES", 0)
    path = tmp_path / "s.h5"
    write(path, storage)
    poison(path, name, 5 + 3, pattern)  # sample 2 (rows 6..12), its third row
    hidden = name.replace("scale", "hidden")
    with ShardReader(path) as r:  # default: each read checks its sample
        r.read(0), r.read(1)
        with pytest.raises(ShardError, match=f"{path}: sample 2: non-finite values in {hidden}"):
            r.read(2)
    with pytest.raises(ShardError, match=f"{path}: non-.*values in {name} row 8; rebuild"):
        validate_shard(path)
    with ShardReader(path, check_values=False) as r:  # trusts an earlier scan: no check
        r.read(2)


@pytest.mark.parametrize("storage", STORAGES)
def test_bytes_per_token_match_the_files(tmp_path, storage):
    """Per token, the datasets hold bytes_per_token + 5 (input_ids int32, loss_mask uint8);
    the rest of the file is a fixed few KiB of HDF5 metadata."""
    n = 1000
    path = tmp_path / "s.h5"
    with ShardWriter(
        path, meta(storage), ["a:1", "a:2"], [[1] * n, [2] * n], [[1] * n, [0] * n]
    ) as w:
        for i in range(2):
            w.put(i, torch.ones(n, N_AUX * H), torch.ones(n, H))
    with h5py.File(path, "r") as f:
        per_sample = {"offsets": 8 * 3, "sample_ids": 16 * 2}  # not per token
        data = sum(f[k].id.get_storage_size() - per_sample.get(k, 0) for k in f)
    assert data == 2 * n * (bytes_per_token(storage, N_AUX + 1, H) + 5)
    assert 0 < path.stat().st_size - data < 16 << 10
    assert bytes_per_token("float8_e4m3", 4, 4096) == 4 * 4096 + 8  # Llama-3.1-8B: 16 KiB + 8
    assert bytes_per_token("bfloat16", 4, 4096) == 32 * 1024


# ----------------------------------------------------------------------------- float8_e4m3

E4M3_VALUES = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_FINITE = E4M3_VALUES[torch.isfinite(E4M3_VALUES)]  # [254]: NaN codes 0x7F, 0xFF left out
SLACK = 1 + 2.0**-18  # float32 rounding of x / scale and of code * scale


def float8_rows(rng) -> torch.Tensor:
    """[24, 96] float32 rows with very different magnitudes, outliers, a zero row, tiny values."""
    x = torch.from_numpy(rng.standard_normal((24, 96))).float()
    x *= torch.logspace(-3, 3, 24)[:, None]  # row amax from ~1e-3 to ~1e3
    x[3, 5] = 5e4  # one massive activation: the rest of its row falls into subnormal codes
    x[4] = 0.0
    x[5, :48] *= 1e-7
    return x


def test_float8_quantization_is_round_to_nearest_with_a_per_token_scale():
    x = float8_rows(np.random.default_rng(0))
    codes, scale = quantize_e4m3(x)
    amax = x.abs().amax(dim=1)
    assert np.array_equal(
        scale, np.maximum(amax.numpy() * np.float32(1 / 448), np.float32(2.0**-126))
    )
    q = torch.from_numpy(codes).view(torch.float8_e4m3fn).float()  # [24, 96]
    y = x * (1 / torch.from_numpy(scale))[:, None]  # what the quantizer rounds
    nearest = (E4M3_FINITE[None, None, :] - y[..., None]).abs().amin(dim=-1)
    assert torch.equal((q - y).abs(), nearest)  # no closer e4m3 value exists
    assert q.abs().max() == 448  # every nonzero row's largest value uses the top code


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_float8_round_trip_error_bound(tmp_path, out_dtype, map_all):
    """Derived bound (docs/shard-format.md): e4m3 keeps 3 mantissa bits, so rounding x / s to
    the nearest code errs by at most 2^-4 of the value in the normal range (|x / s| >= 2^-6)
    and by 2^-10 (half the subnormal spacing) below; the top binade [256, 448] has spacing
    32. With s = amax / 448: |x^ - x| <= 2^-4 |x| + 2^-10 s per value, and per token row
    max |x^ - x| <= 16 s = amax / 28 (3.6%). Reading to bfloat16 rounds once more (2^-9)."""
    sids, ids, masks = tokens([24, 3])
    x = float8_rows(np.random.default_rng(0))
    path = tmp_path / "s.h5"
    with ShardWriter(path, meta("float8_e4m3", hidden_size=32), sids, ids, masks) as w:
        w.put(0, x, x[:, :32] * 3)
        w.put(1, torch.zeros(3, 96), torch.zeros(3, 32))
    with ShardReader(path) as r:
        got = r.read(0, dtype=out_dtype)
        exact = r.read(0)  # float32 by default
        assert exact["aux_hidden"].dtype == torch.float32
        assert torch.equal(r.read(1)["aux_hidden"], torch.zeros(3, 96))
    raw = raw_hidden(path, 0)
    codes = torch.from_numpy(raw["aux_hidden"]).view(torch.float8_e4m3fn)
    s = torch.from_numpy(raw["aux_scale"])[:, None]  # [24, 1]
    assert torch.equal(exact["aux_hidden"], codes.float() * s)  # dequantization is exact
    if out_dtype is not None:
        assert got["aux_hidden"].dtype == out_dtype
        assert torch.equal(got["aux_hidden"], exact["aux_hidden"].to(out_dtype))
    for name, ref in (("aux_hidden", x), ("final_hidden", x[:, :32] * 3)):
        err = (exact[name] - ref).abs()  # [24, W]
        scale = torch.from_numpy(raw[name.replace("hidden", "scale")])[:, None]
        assert bool((err <= (2.0**-4 * ref.abs() + 2.0**-10 * scale) * SLACK).all())
        amax = ref.abs().amax(dim=1)
        row = err.amax(dim=1)  # [24]
        assert bool((row <= amax / 28 * SLACK).all())
        live = amax > 0
        assert float((row[live] / amax[live]).max()) > 0.9 / 28  # the bound is tight, not loose
    # the rows around the outlier keep their sign and about their size
    assert torch.equal(torch.sign(exact["aux_hidden"][5, 48:]), torch.sign(x[5, 48:]))


def test_float8_halves_bfloat16_disk():
    for H_ in (128, 4096):
        assert bytes_per_token("float8_e4m3", 4, H_) / bytes_per_token("bfloat16", 4, H_) < 0.51


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3"])
def test_packed_batches_read_what_the_reader_reads(tmp_path, storage):
    """PackedShards (training's data path) copies the reader's values, float8 dequantized to
    float32; values_checked=False keeps the per-sample check, True skips it."""
    path = tmp_path / "s.h5"
    write(path, storage)
    expect = {k: getattr(meta(storage), k) for k in CHECKED_FIELDS}
    with ShardReader(path) as r:
        ref = [r.read(i, dtype=torch.float32) for i in range(len(r))]
    for checked in (False, True):
        data = PackedShards([path], expect, max_tokens=32, gap=2, values_checked=checked)
        assert [rd.check_values for rd in data.readers] == [not checked]
        assert data.refs == [(0, 0), (0, 2)]  # sample 1 has a single token: nothing to predict
        batch = data.batch([1, 0])
        n2, n0 = LENGTHS[2] - 1, LENGTHS[0] - 1
        assert batch["document_ids"][0].tolist() == [0] * n2 + [-1, -1] + [1] * n0 + [-1, -1]
        h = batch["hidden_states"][0]  # [L, 3H] float32
        assert torch.equal(h[:n2], ref[2]["aux_hidden"][:-1])
        assert torch.equal(h[n2 + 2 : n2 + 2 + n0], ref[0]["aux_hidden"][:-1])
        assert not h[n2 : n2 + 2].any()
        v = batch["verifier_last_hidden_states"][0]
        assert torch.equal(v[:n2], ref[2]["final_hidden"][1:])
        data.close()


@pytest.mark.slow  # builds a tiny target world and trains one epoch (~6 s + imports)
def test_train_reads_float8_shards(tmp_path):
    """The pipeline end to end on float8_e4m3 shards of real hidden states: training's batches
    hold the bf16 shards' values within the float8 bound, and a draft trains on them."""
    from eyrie.formats.report import shard_expectation
    from eyrie.train.recipe import TrainPaths, train
    from tests.support.train_helpers import build_world, train_settings, write_shard

    world = build_world(tmp_path / "world", num_conversations=8)
    fp8 = []
    for s, path in enumerate(world["shards"]):
        with ShardReader(path) as r:
            sids = r.sample_ids()
        fp8.append(tmp_path / f"fp8_{s}.h5")
        write_shard(
            fp8[-1],
            world["model"],
            world["samples"][s :: len(world["shards"])],
            ShardMeta(**world["meta"], storage_dtype="float8_e4m3"),
            sids,
        )
    expect = shard_expectation(world["preflight"])
    a = PackedShards(world["shards"], expect, max_tokens=128, gap=2)
    b = PackedShards(fp8, expect, max_tokens=128, gap=2)
    x, y = a.batch([0, 1]), b.batch([0, 1])
    for k in ("hidden_states", "verifier_last_hidden_states"):
        amax = x[k][0].abs().amax(dim=1)  # [L]
        err = (y[k][0] - x[k][0]).abs().amax(dim=1)
        # float8 of the float32 states vs their bf16 rounding: 1/28 plus one bf16 rounding step
        assert bool((err <= amax * (1 / 28 + 2.0**-8)).all())
    assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "loss_mask", "document_ids"))
    a.close(), b.close()
    summary = train(
        TrainPaths(
            world["target"],
            world["preflight"],
            world["vocab"],
            fp8,
            tmp_path / "train",
            tmp_path / "state",
        ),
        train_settings(epochs=1),
    )
    losses = [
        json.loads(x)["loss"]
        for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()
    ]
    assert summary["steps"] == len(losses) > 0 and all(np.isfinite(losses))
    assert (tmp_path / "train" / "draft" / "model.safetensors").is_file()


def _resident(fd: int, offset: int) -> bool:
    """The kernel's own word on whether the page at `offset` of the file open as `fd` is in the
    page cache: mincore(2) over a fresh read-only map of it, which faults nothing in (through
    eyrie.formats.pagecache's libc, whose mmap, munmap and mincore it declares)."""
    import ctypes
    import mmap

    libc = shards_pagecache._LIBC
    addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    try:
        vec = (ctypes.c_ubyte * 1)()
        assert libc.mincore(addr, mmap.PAGESIZE, vec) == 0, ctypes.get_errno()
        return bool(vec[0] & 1)
    finally:
        libc.munmap(addr, mmap.PAGESIZE)


def _write_uncached(path, data: bytes) -> None:
    """Write `data` to `path` bypassing the page cache (O_DIRECT) where the filesystem allows,
    then ask for whatever it cached to be dropped."""
    import mmap

    with mmap.mmap(-1, len(data)) as buf:  # page-aligned, as O_DIRECT wants
        buf.write(data)
        for flags in (getattr(os, "O_DIRECT", 0), 0):  # a filesystem without O_DIRECT: buffered
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags)
            try:
                os.write(fd, buf)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                break
            except OSError:
                if not flags:
                    raise
            finally:
                os.close(fd)


@pytest.mark.skipif(
    shards_pagecache._LIBC is None
    or not hasattr(shards_pagecache._LIBC, "mincore")
    or not hasattr(os, "posix_fadvise"),
    reason="map_private needs Linux (MAP_NORESERVE, mincore, posix_fadvise)",
)
def test_a_cold_sample_is_asked_for_whole_and_a_cached_one_is_not(tmp_path, monkeypatch):
    """map_private asks the kernel for a whole sample at once (WILLNEED) only when its first page
    is not in the page cache: cold reads then get large disk requests before the first fault,
    and warm reads skip a WILLNEED over cached pages, which costs them time. The cold file is
    written with O_DIRECT (no page cache; a buffered write and DONTNEED can leave the page
    cached), and the test starts only where mincore says its pages are not cached."""
    import mmap

    page = mmap.PAGESIZE
    path = tmp_path / "pages.bin"
    data = os.urandom(1 << 20)
    _write_uncached(path, data)
    asked = []
    fadvise = os.posix_fadvise
    monkeypatch.setattr(
        os,
        "posix_fadvise",
        lambda fd, offset, length, advice: (
            asked.append((offset, length, advice)),
            fadvise(fd, offset, length, advice),
        ),
    )
    start, length = 2 * page + 100, 512 << 10
    last = (start + length - 1) // page * page
    fd = os.open(path, os.O_RDONLY)
    try:
        if _resident(fd, 2 * page) or _resident(fd, last):
            pytest.skip(
                f"{path.parent}: its filesystem keeps pages cached after O_DIRECT writes "
                "and DONTNEED, so no cold sample can be made here"
            )
        cold = shards_pagecache.map_private(fd, start, length)
        assert asked == [(2 * page, length + 100, os.POSIX_FADV_WILLNEED)]
        # nothing touched the map: only WILLNEED brings the sample's last page in
        deadline = time.monotonic() + 30
        while not _resident(fd, last) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _resident(fd, last), "WILLNEED brought nothing in within 30 s"
        assert cold.tobytes() == data[start : start + length]
        asked.clear()
        warm = shards_pagecache.map_private(fd, start, length)
        assert asked == [] and warm.tobytes() == data[start : start + length]
    finally:
        os.close(fd)
