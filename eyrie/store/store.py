"""The output store: the expensive outputs kept by what made them, so that a rerun Snakemake
plans for outputs made before (a setting reverted, an output deleted, a failed run's cleanup)
takes seconds instead of GPU-hours.

`<root>/<kind>/<key[:2]>/<key>/` holds an output's files and `entry.json` (what it is, the key's
material, when it was stored), renamed into place complete. The key is the sha256 of the
canonical JSON of everything that determines the output (`key`). Files are hard links to the
output where the store shares its filesystem (no extra disk while the output exists; the store
keeps the old bytes alive once Snakemake deletes or replaces it), copies otherwise. Every
writer publishes by rename, never in place, so a link is never changed under the store. An
entry records each file's size and sampled digest; a restore checks them and drops a damaged
entry (a truncated output cuts its linked entry too). A restore links an entry to one output at
most: where another output (another run name) links it already, it gets a copy of its own (a
reflink where the filesystem has them), so that the time a restore sets is never that output's.
The workflow sets the root in EYRIE_STORE (config `store.path`); unset, nothing is stored.
Standard library only: the shard client and the vLLM environment use it. docs/store.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from eyrie.core.io import sync_path

log = logging.getLogger(__name__)

ENV = "EYRIE_STORE"
# Bumped when a kind's output for the same key material changes (its writer changed).
VERSIONS = {"hidden": 1, "regenerated": 1}
ENTRY = "entry.json"
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 4096  # sampled_digest: what a restore reads to check an entry
FICLONE = 0x40049409  # Linux's ioctl for a reflink (btrfs, XFS, bcachefs)


def key(kind: str, material: dict) -> str:
    """The key of `kind`'s output made from `material` (JSON; key order does not matter)."""
    text = json.dumps({"kind": kind, "version": VERSIONS[kind], **material}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        _clone_or_copy(src, dest)


def _clone_or_copy(src: Path, dest: Path) -> None:
    """A copy of its own: a reflink (copy-on-write: no extra disk) where the filesystem has
    them, else the bytes."""
    try:
        with open(src, "rb") as fin, open(dest, "wb") as fout:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
        shutil.copystat(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def sampled_digest(path: str | Path) -> str:
    """sha256 of a file's size and SAMPLE_BLOCKS blocks spread over it (first and last
    included): reads ~64 KiB however large the file, and catches a file cut short, extended or
    overwritten in a sampled block."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        last = max(size - SAMPLE_BYTES, 0)
        for i in range(SAMPLE_BLOCKS):
            f.seek(last * i // (SAMPLE_BLOCKS - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


@dataclass(frozen=True)
class Entry:
    kind: str
    key: str
    path: Path
    bytes: int  # all its files
    held_bytes: int  # the bytes only the store holds (no output links to them)
    used: float  # last stored or restored (seconds since the epoch)


class Store:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    @classmethod
    def from_env(cls) -> Store | None:
        root = os.environ.get(ENV)
        return cls(root) if root else None

    def entry(self, kind: str, k: str) -> Path:
        return self.root / kind / k[:2] / k

    def restore(self, kind: str, k: str, outputs: dict[str, Path]) -> bool:
        """Put the stored files of (kind, key) at `outputs` (name -> path), each renamed into
        place; False when the store has no complete entry. A store that cannot be read is a
        miss (logged), never a failure: the stage then computes the output."""
        entry = self.entry(kind, k)
        if not (entry / ENTRY).is_file() or not all((entry / n).is_file() for n in outputs):
            return False
        damage = _damage(entry, outputs)
        if damage:  # an output is a link to its entry: truncating one cut both
            log.warning("store: %s is damaged (%s): removed; computing the output", entry, damage)
            _remove_entry(entry)
            return False
        tmp = None
        try:
            for name, dest in outputs.items():
                dest = Path(dest)
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                if os.stat(entry / name).st_nlink > 1:
                    # another output (another run name) links the entry: the time set below
                    # would be its time too, and Snakemake would replan what follows it there
                    _clone_or_copy(entry / name, tmp)
                else:
                    _link_or_copy(entry / name, tmp)
                os.utime(tmp)  # new to Snakemake: older than its inputs, it would rerun again
                os.replace(tmp, dest)
            os.utime(entry / ENTRY)  # last used: what `eyrie store --prune` keeps
        except OSError as exc:  # a full disk: the partial copy goes, the stage computes it
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            log.warning("store: could not restore %s from %s (%s): computing it", kind, entry, exc)
            return False
        log.info("store: restored %s from %s", ", ".join(map(str, outputs.values())), entry)
        return True

    def put(self, kind: str, k: str, outputs: dict[str, Path], material: dict) -> None:
        """Keep `outputs` (name -> path) under (kind, key). A failure to store (a full or
        read-only store) is a warning: the output itself is good."""
        entry = self.entry(kind, k)
        if (entry / ENTRY).is_file():
            return
        tmp = entry.with_name(f".{k}.tmp-{os.getpid()}")
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for name, src in outputs.items():
                _link_or_copy(Path(src), tmp / name)
            record = {"kind": kind, "key": k, "material": material, "stored": time.time()}
            record["files"] = {n: os.stat(tmp / n).st_size for n in outputs}
            record["sampled_sha256"] = {n: sampled_digest(tmp / n) for n in outputs}
            (tmp / ENTRY).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            for name in (*outputs, ENTRY):
                sync_path(tmp / name)
            os.rename(tmp, entry)
            sync_path(entry.parent)
        except OSError as exc:
            if not (entry / ENTRY).is_file():  # else another writer stored the same key first
                log.warning(
                    "store: could not keep %s in %s (%s); the output is fine, but a later "
                    "rerun will compute it again",
                    kind,
                    self.root,
                    exc,
                )
            return
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("store: kept %s as %s", kind, entry)

    def entries(self) -> list[Entry]:
        """Every complete entry, oldest used first."""
        out = []
        for meta in self.root.glob(f"*/??/*/{ENTRY}"):
            folder = meta.parent
            stats = [p.stat() for p in folder.iterdir() if p.is_file()]
            out.append(
                Entry(
                    kind=folder.parent.parent.name,
                    key=folder.name,
                    path=folder,
                    bytes=sum(s.st_size for s in stats),
                    held_bytes=sum(s.st_size for s in stats if s.st_nlink == 1),
                    used=meta.stat().st_mtime,
                )
            )
        return sorted(out, key=lambda e: e.used)

    def damage(self, entry: Entry) -> str | None:
        """Why `entry` is not what was stored (the check a restore makes, on every file it
        recorded and every file it holds), or None."""
        names = {p.name for p in entry.path.iterdir() if p.is_file() and p.name != ENTRY}
        try:
            names |= set(json.loads((entry.path / ENTRY).read_text()).get("files") or {})
        except (OSError, ValueError, AttributeError):
            pass  # _damage names it
        return _damage(entry.path, sorted(names))

    def remove(self, entry: Entry) -> None:
        _remove_entry(entry.path)


def _remove_entry(folder: Path) -> None:
    """Remove an entry's folder, entry.json first: a half-removed entry is never restored."""
    (folder / ENTRY).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def _damage(entry: Path, names) -> str | None:
    """Why an entry's files `names` are not what was stored (each must exist, with the size
    and sampled digest entry.json records for it), or None; an entry.json that cannot be read,
    or that lost a file's size or digest (nothing would then catch a cut file), is damage too."""
    try:
        meta = json.loads((entry / ENTRY).read_text())
        recorded, digests = meta.get("files") or {}, meta.get("sampled_sha256") or {}
    except (OSError, ValueError, AttributeError) as exc:
        return f"{ENTRY} unreadable: {exc}"
    for name in names:
        if not (entry / name).is_file():
            return f"{name} is gone"
        if name not in recorded or name not in digests:
            return f"{ENTRY} records no size or sampled digest for {name}"
        size, want = os.stat(entry / name).st_size, recorded[name]
        if size != want:
            return f"{name} holds {size:,} bytes, {want:,} when stored"
        if sampled_digest(entry / name) != digests[name]:
            return f"{name}: its sampled content differs from when it was stored"
    return None
