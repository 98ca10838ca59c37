"""Outputs appear complete or not at all (eyrie.io.atomic_path)."""

from __future__ import annotations

import pytest

from eyrie.io import atomic_path


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
