"""Exported draft versions: `results/<name>/drafts/<id>/` (complete folders, named by their
content) and the link `results/<name>/draft` to the newest good one.

The workflow's export output is `draft.json` (the manifest), never the draft's files: Snakemake
deletes a job's outputs before it runs and after it fails, and a failed export must not take
away the draft `vllm serve` is using. The link is replaced by rename only after the new version
passed its checks; the KEEP newest versions stay (and always the linked one). docs/export-format.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from eyrie.core.io import atomic_path, file_sha256, sync_path

KEEP = 3
HASHED = ("config.json", "model.safetensors")  # a version's id and the manifest's digests


class DraftVersions:
    """The versions beside `link` (results/<name>/draft) in `drafts/`."""

    def __init__(self, link: str | Path):
        self.link = Path(link)
        self.root = self.link.parent / "drafts"
        self.staging = self.root / ".staging"
        self.files: dict[str, str] | None = None  # the published version's digests (HASHED)

    @contextlib.contextmanager
    def new(self) -> Iterator[Path]:
        """A temporary folder for the next version; kept for `publish` only if the block ends
        without an error."""
        self.root.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.staging) as tmp:
            yield tmp

    def digests(self, version: Path) -> dict[str, str]:
        return {name: file_sha256(version / name) for name in HASHED}

    def publish(self) -> Path:
        """Name the staged version by its content, point the link at it, prune old versions;
        `files` then holds its digests (one pass over a draft of gigabytes)."""
        self.files = self.digests(self.staging)
        digest = hashlib.sha256("".join(self.files[n] for n in HASHED).encode()).hexdigest()
        final = self.root / f"draft-{digest[:12]}"
        if final.is_dir():  # the same draft exported again
            shutil.rmtree(self.staging)
            os.utime(final)
        else:
            os.rename(self.staging, final)  # its files were fsynced by atomic_path
            sync_path(self.root)
        self._adopt_folder()
        tmp = self.link.with_name(f".{self.link.name}.link-{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.symlink(os.path.join(self.root.name, final.name), tmp)
        os.replace(tmp, self.link)
        sync_path(self.link.parent)
        self.prune()
        return final

    def _adopt_folder(self) -> None:
        """A real folder at the link's path (an export by an older eyrie) becomes a version."""
        if self.link.is_dir() and not self.link.is_symlink():
            stamp = self.link.stat().st_mtime_ns
            os.rename(self.link, self.root / f"folder-{stamp}")

    def current(self) -> Path | None:
        return self.link.resolve() if self.link.is_symlink() and self.link.exists() else None

    def versions(self) -> list[Path]:
        """Every complete version, oldest first."""
        found = [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]
        return sorted(found, key=lambda p: p.stat().st_mtime_ns)

    def prune(self, keep: int = KEEP) -> None:
        current = self.current()
        for old in self.versions()[:-keep]:
            if old.resolve() != current:
                shutil.rmtree(old)
