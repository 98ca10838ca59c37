"""Outputs appear complete or not at all, and durably (eyrie.core.io.atomic_path)."""

from __future__ import annotations

import errno
import os

import pytest

from eyrie.core.io import atomic_path


def test_a_failed_write_leaves_neither_output_nor_temporary(tmp_path):
    final = tmp_path / "shard_000.h5"
    with pytest.raises(RuntimeError):
        with atomic_path(final) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_what_a_killed_writer_left_is_removed_by_the_next_write(tmp_path):
    """SIGKILL runs no cleanup: its temporary (another pid) stays until the next write."""
    final = tmp_path / "shard_000.h5"
    stale = tmp_path / ".shard_000.h5.tmp-999999"
    other = tmp_path / ".shard_001.h5.tmp-999999"  # another output's: not ours to remove
    stale.write_bytes(b"partial")
    other.write_bytes(b"partial")
    with atomic_path(final) as tmp:
        tmp.write_bytes(b"complete")
    assert final.read_bytes() == b"complete"
    assert not stale.exists() and other.exists()


def _record_fsyncs(monkeypatch, final) -> list[tuple[str, bool]]:
    """os.fsync records (the path of its fd, whether `final` exists yet) and then syncs."""
    calls, real = [], os.fsync

    def fsync(fd):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), final.exists()))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_a_file_is_fsynced_before_the_rename_and_its_folder_after(tmp_path, monkeypatch):
    final = tmp_path / "out" / "draft.json"
    calls = _record_fsyncs(monkeypatch, final)
    with atomic_path(final) as tmp:
        tmp.write_text("{}")
    assert calls == [(str(tmp), False), (str(final.parent), True)]


def test_a_folder_is_fsynced_file_by_file_below_first_then_renamed(tmp_path, monkeypatch):
    final = tmp_path / "step_00000004"
    calls = _record_fsyncs(monkeypatch, final)
    with atomic_path(final) as tmp:
        (tmp / "sub").mkdir(parents=True)
        (tmp / "sub" / "state.pt").write_bytes(b"s")
        (tmp / "model.safetensors").write_bytes(b"m")
        (tmp / "link").symlink_to("model.safetensors")  # not followed, not synced twice
    # a folder after its files (its entries name them), the temporary last, the parent after
    assert calls == [
        (str(tmp / "sub" / "state.pt"), False),
        (str(tmp / "sub"), False),
        (str(tmp / "model.safetensors"), False),
        (str(tmp), False),
        (str(tmp_path), True),
    ]
    assert (final / "sub" / "state.pt").read_bytes() == b"s"


def test_a_failed_fsync_keeps_the_old_output(tmp_path, monkeypatch):
    """EIO from fsync is a write the disk lost: the new output is not published."""
    final = tmp_path / "shard_000.h5"
    final.write_bytes(b"old")

    def fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="Input/output error"):
        with atomic_path(final) as tmp:
            tmp.write_bytes(b"new")
    assert final.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [final]


def test_the_last_good_copy_outlives_its_output_emptied_in_place(tmp_path):
    """keep_last_good copies: a report emptied or rewritten in place (an editor, `> file`)
    leaves `.last-good/` whole; it was a hard link, emptied with it."""
    from eyrie.core.io import keep_last_good

    report = tmp_path / "eval.json"
    report.write_text('{"ok": true}\n')
    keep = keep_last_good(report)
    with open(report, "w"):
        pass  # emptied in place: the same inode
    assert keep.read_text() == '{"ok": true}\n' and report.read_text() == ""
    assert os.stat(keep).st_ino != os.stat(report).st_ino
    assert sorted(p.name for p in keep.parent.iterdir()) == ["eval.json"]  # no temporary left
