"""Atomic outputs and provenance, for every stage that writes a file.

`atomic_path` writes a file or folder under a temporary sibling name and renames it into place only
when the write succeeded, so a partial output never looks complete (a killed writer's temporary is
removed by the next one); `write_json` writes a JSON file that way. `provenance(settings)` is what
produced an output (command, settings, git SHA, package versions, host, time). docs/contracts.md.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Iterator


def remove_stale_temporaries(final: str | Path) -> None:
    """Remove what killed writers of `final` left (`.<name>.tmp-<pid>`: SIGKILL runs no
    cleanup). One writer per output at a time: Snakemake never runs two jobs for one output."""
    final = Path(final)
    for stale in final.parent.glob(f".{glob.escape(final.name)}.tmp-*"):
        _remove(stale)


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it to `final` only if the block succeeds.

    Works for files and folders. On failure the temporary is removed and `final` untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    remove_stale_temporaries(final)
    try:
        yield tmp
        _apply_umask(tmp)
        if final.exists():
            _remove(final)
        os.replace(tmp, final)
    finally:
        _remove(tmp)


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


def write_json(path: str | Path, obj) -> None:
    """`obj` as indented JSON with sorted keys, written atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _git_sha() -> str | None:
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
