"""Atomic outputs and provenance, for every stage that writes a file.

`atomic_path` writes a file or folder under a temporary sibling name and renames it into place only
when the write succeeded, so a partial output never looks complete (a killed writer's temporary is
removed by the next one); what it renames is fsynced before the rename and its folder after, so a
machine that loses power keeps the old output or the complete new one. `write_json` writes a JSON
file that way. `provenance(settings)` is what produced an output (command, settings, git SHA,
package versions, host, time). `file_sha256` hashes a file. docs/contracts.md.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Iterator


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes (hex), read 1 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def remove_stale_temporaries(final: str | Path) -> None:
    """Remove what killed writers of `final` left (`.<name>.tmp-<pid>`: SIGKILL runs no
    cleanup). One writer per output at a time: Snakemake never runs two jobs for one output."""
    final = Path(final)
    for stale in final.parent.glob(f".{glob.escape(final.name)}.tmp-*"):
        _remove(stale)


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it to `final` only if the block succeeds.

    Works for files and folders. Every file and folder under the temporary is fsynced before the
    rename and the parent folder after it: without that a crash can leave a renamed name whose
    data never reached the disk. On failure the temporary is removed and `final` untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    remove_stale_temporaries(final)
    try:
        yield tmp
        _apply_umask(tmp)
        sync_tree(tmp)
        if final.exists():
            _remove(final)
        os.replace(tmp, final)
        sync_path(final.parent)
    finally:
        _remove(tmp)


def sync_path(path: Path) -> None:
    """fsync one file or folder (a folder: its entries). A filesystem that cannot fsync this
    kind of file (EINVAL, ENOTSUP) is left as it is; a failed write (EIO, ENOSPC) raises."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def sync_tree(path: Path) -> None:
    """fsync a file, or every regular file of a folder and then every folder, the deepest first
    and `path` last (a file's name lives in its folder); symbolic links are not followed."""
    if not path.is_dir() or path.is_symlink():
        if stat.S_ISREG(path.lstat().st_mode):
            sync_path(path)
        return
    for top, _, files in os.walk(path, topdown=False):
        for name in files:
            if stat.S_ISREG(os.lstat(os.path.join(top, name)).st_mode):
                sync_path(Path(top, name))
        sync_path(Path(top))


def _apply_umask(path: Path) -> None:
    """Some writers (temporary files, transformers' safetensors) create files 0600; outputs
    are shared on clusters, so give every file the mode the user's umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    mode = 0o666 & ~umask
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        os.chmod(f, mode | (f.stat().st_mode & 0o111))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


LAST_GOOD = ".last-good"  # beside an output: its last good copy (keep_last_good)


def last_good_path(path: str | Path) -> Path:
    """Where keep_last_good keeps `path`'s last good copy."""
    path = Path(path)
    return path.parent / LAST_GOOD / path.name


def keep_last_good(path: str | Path) -> Path:
    """Copy a just-written output to `.last-good/<name>` beside it: Snakemake deletes a job's
    outputs before the job runs, so a rerun that fails would leave the user without the last
    good report; the failure lines name this copy (eyrie.core.failures). A copy, not a link: an
    output emptied or edited in place must not take its last good copy with it. The outputs kept
    are reports and the eval set (kilobytes to megabytes)."""
    keep = last_good_path(path)
    keep.parent.mkdir(exist_ok=True)
    with atomic_path(keep) as tmp:
        shutil.copy2(path, tmp)
    return keep


def write_json(path: str | Path, obj) -> None:
    """`obj` as indented JSON with sorted keys, written atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


@functools.cache
def _git_sha() -> str | None:
    """The checkout's commit, once per process (a subprocess per shard otherwise)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(settings: dict | None = None) -> dict:
    """What produced an output: command, settings, git SHA, package versions, host."""
    versions = {}
    for pkg in ("eyrie", "torch", "transformers", "tokenizers", "speculators", "h5py", "snakemake"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "command": sys.argv,
        "settings": settings,
        "git_sha": _git_sha(),
        "versions": versions,
        "python": sys.version.split()[0],
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


@contextlib.contextmanager
def file_lock(path: Path, exclusive: bool, wait_s: float | None = None) -> Iterator[bool]:
    """flock(2) on `path` (created): exclusive or shared, released with the block or when the
    process dies. Yields whether it is held: False when the file cannot be opened or another
    still holds it after `wait_s` seconds (None: wait as long as it takes)."""
    import fcntl

    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")
    except OSError:
        yield False
        return
    with handle:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, mode | (0 if deadline is None else fcntl.LOCK_NB))
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.2)
            except OSError:  # a file system without flock (some network mounts): go on unlocked
                yield False
                return
        yield True
