"""The installed vLLM's facts kept on disk, so that a job asks a vLLM environment once per config.

Reading the facts imports vLLM and builds its config classes (16–22 s on an H100 machine); the
preflight and evaluate-vllm of every run, and each extraction engine, read the same ones. The
folder is EYRIE_VLLM_FACTS_CACHE (cache.path/vllm-facts through eyrie.core.runtime.CACHES; unset:
no cache). An entry's name is a digest of everything the facts are read from: the config, this
Python and its search path, every installed distribution (name, version, its RECORD of files and
digests), eyrie's own source, the VLLM_* variables (but logging's) and whether NVIDIA devices are
present. An upgrade, a reinstall or an edit of eyrie therefore reads the facts again; an entry is
never updated in place. One job reads an entry at a time (`reading`); the others wait, then load.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from eyrie.core.io import file_lock, write_json
from eyrie.core.runtime import VLLM_FACTS_CACHE as ENV

log = logging.getLogger(__name__)
EYRIE_SOURCE = Path(__file__).resolve().parents[1]  # the eyrie package this process runs


def folder() -> Path | None:
    """The cache's folder, or None when EYRIE_VLLM_FACTS_CACHE is unset or empty."""
    path = os.environ.get(ENV)
    return Path(path) if path else None


@functools.cache
def environment_key() -> str:
    """Digest of what the facts depend on besides the target's config (this process's lifetime:
    nothing is installed under a running job)."""
    h = hashlib.sha256()

    def add(*parts) -> None:
        for part in parts:
            h.update(str(part).encode())
            h.update(b"\0")

    # sys.path[0] is the script's folder or the working directory (`python -m` from a temporary
    # one in preflight): not the environment; a distribution found there is listed below
    add(sys.version, sys.executable, *sys.path[1:])
    dists = []
    for dist in importlib.metadata.distributions():
        record = dist.read_text("RECORD") or ""
        dists.append((dist.name or "", dist.version, hashlib.sha256(record.encode()).hexdigest()))
    for name, version, record in sorted(dists):
        add(name, version, record)
    for path in sorted(EYRIE_SOURCE.rglob("*.py")):  # an editable eyrie has no RECORD of them
        add(path.relative_to(EYRIE_SOURCE), hashlib.sha256(path.read_bytes()).hexdigest())
    add(
        *sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("VLLM_") and not quiet(k))
    )
    add(bool(glob.glob("/dev/nvidia[0-9]*")))
    return h.hexdigest()


def quiet(name: str) -> bool:
    """A VLLM_* variable that shapes only vLLM's logging (preflight's probe sets
    VLLM_LOGGING_LEVEL=ERROR): out of the key, so the engines' jobs find the facts it kept."""
    return name.startswith(("VLLM_LOGGING", "VLLM_CONFIGURE_LOGGING"))


def entry_path(config: dict) -> Path | None:
    """Where the facts of `config` in this environment are kept (None: no cache)."""
    root = folder()
    if root is None:
        return None
    h = hashlib.sha256(environment_key().encode())
    h.update(json.dumps(config, sort_keys=True).encode())
    return root / f"{h.hexdigest()[:32]}.json"


# a job waits this long at most for another that reads the same facts (16-22 s), then reads them
# itself: within preflight's 120 s for the whole probe (eyrie.preflight.vllm_env.FACTS_TIMEOUT_S)
LOCK_WAIT_S = 90


@contextlib.contextmanager
def reading(config: dict) -> Iterator[None]:
    """Held while one job reads the facts of `config`: another job asking for the same ones
    meanwhile (preflight's probe while compile-kernels reads them at the workflow's start) waits,
    then loads them instead of importing vLLM a second time. Without a cache, or after
    LOCK_WAIT_S, it goes on without the lock: both read, the same facts."""
    path = entry_path(config)
    if path is None:
        yield
        return
    with file_lock(path.with_suffix(".lock"), exclusive=True, wait_s=LOCK_WAIT_S):
        yield


def load(config: dict) -> dict | None:
    """The kept facts (VllmFacts.to_json()) of `config` in this environment, or None. An entry
    that cannot be read counts as absent: the facts are read again and replace it."""
    path = entry_path(config)
    if path is None or not path.is_file():
        return None
    try:
        facts = json.loads(path.read_text())["facts"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return facts if isinstance(facts, dict) else None


def store(config: dict, facts: dict) -> None:
    """Keep `facts` for `config` (atomically). A cache folder that cannot be written costs the
    next job the read again, nothing else: a warning, not a failure."""
    path = entry_path(config)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"facts": facts, "config_architectures": config.get("architectures")})
    except OSError as exc:
        log.warning(
            "%s: the vLLM facts were not kept (%s); set %s or cache.path to a "
            "writable folder to keep them",
            path,
            exc,
            ENV,
        )
