"""eyrie.formats.pagecache: TODO docstring."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform

import numpy as np

log = logging.getLogger(__name__)


# Hidden-state reads from this size up are mapped, smaller ones copied by pread (a map, its
# faults and its unmap cost more than copying a few MiB: crossover measured at 2-4 MiB).
MAP_MIN_BYTES = 3 << 20


# MAP_NORESERVE (absent from Python's mmap module): no swap reserved for a private writable map
# (the default overcommit heuristic refuses one larger than RAM: measured with a 100 GB file).
MAP_NORESERVE = {"x86_64": 0x4000, "aarch64": 0x4000, "arm64": 0x4000}.get(platform.machine())


def _libc_mmap():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        if hasattr(libc, "mincore"):
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc_mmap() if MAP_NORESERVE is not None else None


class _Map:
    """One private map; numpy arrays over it hold it (as their base) and unmap it when freed."""

    def __init__(self, addr: int, size: int):
        self.addr, self.size, self.munmap = addr, size, _LIBC.munmap
        self.__array_interface__ = {
            "data": (addr, False),
            "shape": (size,),
            "typestr": "|u1",
            "version": 3,
        }

    def __del__(self):
        self.munmap(self.addr, self.size)


def _first_page_cached(addr: int) -> bool:
    """Whether the page mapped at `addr` (the first page of a file map, not yet touched) is in the
    page cache: mincore(2), which reads nothing. (A read that must not wait, preadv RWF_NOWAIT,
    starts readahead and answers "cached" when that finishes before it looks again: 4 times in 30
    on a loaded 2-core machine.) The kernel answers truly only for files the process owns or may
    write; for others it says cached, and the read goes on as without the probe. True where libc
    has no mincore or it fails."""
    vec = ctypes.c_ubyte(0)
    if not hasattr(_LIBC, "mincore") or _LIBC.mincore(addr, mmap.PAGESIZE, ctypes.byref(vec)):
        return True
    return bool(vec.value & 1)


def map_private(fd: int, start: int, length: int) -> np.ndarray:
    """Bytes start:start+length of the file open as `fd`, as a writable uint8 array [length]
    over a private (copy-on-write) map of their own: writes never reach the file nor another
    read's array. Unmapped when the last array or tensor over it is freed.

    Cold reads (measured on the 2-core CPU machine, 1.5 GB of random samples, against the
    peer of benchmarks/read_path.py): the map goes through a new open file of the same inode
    (/proc/self/fd), because the kernel keeps readahead state per open file and stops reading
    ahead for mmap faults after ~100 that missed the cache, which random samples of one shard
    soon cause (0.65-0.8x of the peer's cold speed with one open file per shard). A 4 KiB read
    at the first page then started readahead forward from there; a first fault would read half
    a window (4 MiB here) of the rows before the sample first (0.81-0.94x -> 0.95-1.0x). Now,
    when the first page is not in the page cache, posix_fadvise(WILLNEED) asks for the whole
    range at once, so the disk gets large requests before the first fault (cold: 1.10x -> 1.63x
    of the peer at 2 GB, 1.92x at 5 GB, medians of 3); a cached first page (mincore over the
    new map) skips it, because WILLNEED over cached pages costs a warm read ~16 ms per 24 MB
    sample (24.7 -> 41 ms). The price, paid by later warm reads: WILLNEED fills the page cache
    with 4 KiB pages where fault readahead builds large folios, so a warm read of a sample first
    read cold costs ~1.3x more (BENCHMARKS.md, benchmarks/page_cache_fill.py).
    libc's mmap, not Python's: a Python mmap object holds a duplicate file descriptor while
    alive."""
    base = start - start % mmap.PAGESIZE
    size = length + start - base
    try:
        own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    except OSError:  # no /proc: the shared open file
        own = os.dup(fd)
    try:
        addr = _LIBC.mmap(
            None,
            size,
            mmap.PROT_READ | mmap.PROT_WRITE,
            mmap.MAP_PRIVATE | MAP_NORESERVE,
            own,
            base,
        )
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes at {base}: {os.strerror(err)}")
        if hasattr(os, "posix_fadvise") and not _first_page_cached(addr):
            try:
                os.posix_fadvise(own, base, size, os.POSIX_FADV_WILLNEED)  # the whole range, async
            except OSError:  # advice only: the faults read what it would have
                pass
    finally:
        os.close(own)  # the map holds the file open
    return np.asarray(_Map(addr, size))[start - base :]
