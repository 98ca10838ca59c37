"""The output store (eyrie/store, docs/store.md): an output is a hard link to its entry, a
restore checks the entry's recorded sizes and sampled digests and refuses (and removes) a damaged
one, `eyrie store` prunes oldest first and `--verify` removes what a restore would refuse; the
target's fingerprint samples every tensor of a large weight file. The whole-workflow cases (a
reverted setting restoring shards) are in tests/workflow/test_reliability_outputs.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from eyrie.cli import main as cli_main
from eyrie.store.fingerprint import file_digest, track_target
from eyrie.store.store import Store
from tests.support.train_helpers import build_world


def test_fingerprint_samples_each_tensor_and_is_rewritten_only_on_change(tmp_path):
    """A large weight file is read in samples (the middle of each tensor, up to 256), so a
    change of whole tensors is seen without reading the file."""
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text("{}")
    big = target / "model.safetensors"
    tensors = {f"layers.{i}.w": torch.zeros(100_000) for i in range(50)}  # 20 MB: sampled
    save_file(tensors, str(big))
    assert file_digest(big, big.stat().st_size).startswith("sampled:")
    weights = Path(track_target(target, tmp_path / "fp")["weights"])
    first = weights.stat().st_mtime_ns
    os.utime(big)  # touched, same content: not rewritten
    track_target(target, tmp_path / "fp")
    assert weights.stat().st_mtime_ns == first
    tensors["layers.37.w"] = torch.full((100_000,), 1e-3)  # one tensor changed, mtime kept
    st = big.stat()
    save_file(tensors, str(big))
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    track_target(target, tmp_path / "fp")
    assert weights.stat().st_mtime_ns != first


def test_store_restores_by_link_and_prunes_oldest_first(tmp_path, capsys):
    store = Store(tmp_path / "store")
    out = tmp_path / "out.h5"
    out.write_bytes(b"states")
    store.put("hidden", "ab" * 32, {"shard.h5": out}, {"why": "test"})
    out.unlink()  # Snakemake deletes the output before a rerun
    assert store.restore("hidden", "ab" * 32, {"shard.h5": out})
    assert out.read_bytes() == b"states" and out.stat().st_nlink == 2
    assert not store.restore("hidden", "cd" * 32, {"shard.h5": tmp_path / "x.h5"})
    rc = cli_main(["store", "--path", str(store.root), "--prune", "--max-gib", "0"])
    assert rc == 0 and "removed 1 entries" in capsys.readouterr().out
    assert out.read_bytes() == b"states"  # pruning never touches an output
    assert store.entries() == []


def test_a_damaged_entry_is_never_restored(tmp_path, caplog):
    """An output is a hard link to its store entry: a truncated output cuts the entry too. The
    entry's recorded sizes catch it: it is removed and the stage computes the output again."""
    store = Store(tmp_path / "store")
    out = tmp_path / "out.h5"
    out.write_bytes(b"states of a shard")
    store.put("hidden", "ab" * 32, {"shard.h5": out}, {"why": "test"})
    os.truncate(out, 6)  # a disk error, or `truncate`, on the output
    with caplog.at_level("WARNING"):
        assert not store.restore("hidden", "ab" * 32, {"shard.h5": out})
    assert "is damaged (shard.h5 holds 6 bytes, 17 when stored)" in caplog.text
    assert store.entries() == []


def test_an_entry_overwritten_in_place_is_never_restored(tmp_path, caplog):
    """The same size, other bytes (a disk error, a tool writing in place): the sampled digest
    recorded at keep time catches it."""
    store = Store(tmp_path / "store")
    out = tmp_path / "out.h5"
    out.write_bytes(bytes(range(256)) * 64)
    store.put("hidden", "cd" * 32, {"shard.h5": out}, {"why": "test"})
    with open(out, "r+b") as f:
        f.seek(len(out.read_bytes()) - 100)
        f.write(b"\0" * 10)
    with caplog.at_level("WARNING"):
        assert not store.restore("hidden", "cd" * 32, {"shard.h5": out})
    assert "shard.h5: its sampled content differs from when it was stored" in caplog.text
    assert store.entries() == []


def test_two_runs_restoring_one_entry_never_touch_each_others_outputs(tmp_path):
    """Run a's output links the entry; run b's restore gets a copy of its own, so the time it
    sets is not a's (Snakemake would replan what follows a's output)."""
    store = Store(tmp_path / "store")
    a, b = tmp_path / "a" / "shard.h5", tmp_path / "b" / "shard.h5"
    a.parent.mkdir()
    a.write_bytes(b"states" * 1000)
    store.put("hidden", "ef" * 32, {"shard.h5": a}, {"why": "test"})
    os.utime(a, (1_000_000_000, 1_000_000_000))
    assert store.restore("hidden", "ef" * 32, {"shard.h5": b})
    assert a.stat().st_mtime == 1_000_000_000 and b.stat().st_mtime > 1_000_000_000
    assert b.stat().st_ino != a.stat().st_ino and b.read_bytes() == a.read_bytes()
    # with no other output linking it, a restore links the entry again (no extra disk)
    a.unlink()
    assert store.restore("hidden", "ef" * 32, {"shard.h5": a})
    assert a.stat().st_nlink == 2


def test_an_entry_without_its_digests_or_its_file_is_damaged(tmp_path, capsys, caplog):
    """An entry.json that lost its digests let a restore return a cut shard, and `--verify`
    kept an entry whose shard file was gone; both are damage now, to a restore and to
    `eyrie store --verify`."""
    store = Store(tmp_path / "store")
    outs = [tmp_path / f"{n}.h5" for n in range(3)]
    for i, out in enumerate(outs):
        out.write_bytes(b"states of a shard")
        store.put("hidden", f"{i}" * 64, {"shard.h5": out}, {"why": "test"})
    meta = store.entry("hidden", "0" * 64) / "entry.json"
    record = json.loads(meta.read_text())
    del record["sampled_sha256"], record["files"]
    meta.write_text(json.dumps(record))
    os.truncate(outs[0], 6)  # the output links the entry: cut both
    with caplog.at_level("WARNING"):
        assert not store.restore("hidden", "0" * 64, {"shard.h5": tmp_path / "again.h5"})
    assert "entry.json records no size or sampled digest for shard.h5" in caplog.text
    (store.entry("hidden", "1" * 64) / "shard.h5").unlink()
    assert cli_main(["store", "--path", str(store.root), "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"{store.entry('hidden', '1' * 64)}: damaged (shard.h5 is gone)" in out
    assert [e.key for e in store.entries()] == ["2" * 64]


def test_store_verify_removes_the_damaged_entries_a_full_check_reads_shards_whole(tmp_path, capsys):
    """`eyrie store --verify` makes the check a restore makes on every entry; `--verify full`
    also reads each hidden-state shard whole, which catches a NaN written in place between the
    sampled blocks (same size, same sampled bytes)."""
    import h5py

    from eyrie.store.store import SAMPLE_BLOCKS, SAMPLE_BYTES

    world = build_world(tmp_path / "world", num_conversations=160, shards=1)
    store = Store(tmp_path / "store")
    good, cut, nan = (tmp_path / f"{n}.h5" for n in ("good", "cut", "nan"))
    for i, path in enumerate((good, cut, nan)):
        shutil.copy(world["shards"][0], path)
        store.put("hidden", f"{i}" * 64, {"shard.h5": path}, {"why": "test"})
    os.truncate(cut, cut.stat().st_size - 1)
    size = nan.stat().st_size
    sampled = [(size - SAMPLE_BYTES) * k // (SAMPLE_BLOCKS - 1) for k in range(SAMPLE_BLOCKS)]
    with h5py.File(nan, "r+") as f:  # in place, as a tool or a disk error would
        data = f["aux_hidden"]
        row_bytes = data.shape[1] * data.dtype.itemsize
        row = next(  # a row no sampled block reads
            r
            for r in range(data.shape[0])
            if all(
                not (a < data.id.get_offset() + (r + 1) * row_bytes)
                or not (data.id.get_offset() + r * row_bytes < a + SAMPLE_BYTES)
                for a in sampled
            )
        )
        data[row] = 0x7FC0  # NaN in bfloat16
    assert cli_main(["store", "--path", str(store.root), "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"{store.entry('hidden', '1' * 64)}: damaged (" in out
    assert len(store.entries()) == 2  # the NaN is between the sampled blocks
    assert cli_main(["store", "--path", str(store.root), "--verify", "full"]) == 0
    out = capsys.readouterr().out
    assert f"{store.entry('hidden', '2' * 64)}: damaged (" in out and "removed" in out
    assert [e.key for e in store.entries()] == ["0" * 64]
