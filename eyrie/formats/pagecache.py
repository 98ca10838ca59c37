"""The page cache through libc. `map_private` maps a byte range of an open file copy-on-write
and, when its first page is not in the page cache, asks the kernel for the whole range at once.
`_LIBC` is None where this is unavailable (no MAP_NORESERVE, no libc mmap): the reader then
copies with pread instead. `start_writeback` and `wait_writeback` (Linux sync_file_range) let
a writer have its pages written to disk while it writes, not all at its fsync.
docs/shard-format.md ("Reading", "Writing") says why.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform

import numpy as np

# MAP_NORESERVE (absent from Python's mmap module): no swap reserved for a private writable map,
# which the default overcommit heuristic refuses when it is larger than RAM
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

# sync_file_range(2) flags (linux/fs.h)
SYNC_FILE_RANGE_WAIT_BEFORE, SYNC_FILE_RANGE_WRITE = 1, 2


def _libc_sync_file_range():
    if platform.system() != "Linux":
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


_SYNC_FILE_RANGE = _libc_sync_file_range()


# what a file that cannot do write-back on request answers (a pipe, some filesystems, an old
# kernel): left to the kernel and the fsync
UNSUPPORTED = {errno.ESPIPE, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def _sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> bool:
    """sync_file_range(2); False where it is unavailable or the file refuses it (UNSUPPORTED).
    A failed write (EIO, ENOSPC) raises: a wait that saw it marks it seen, so a later fsync
    through another descriptor would not report it."""
    if _SYNC_FILE_RANGE is None or nbytes <= 0:
        return False
    while _SYNC_FILE_RANGE(fd, offset, nbytes, flags) != 0:
        err = ctypes.get_errno()
        if err in UNSUPPORTED:
            return False
        if err != errno.EINTR:
            raise OSError(err, f"write-back of {nbytes} bytes at {offset}: {os.strerror(err)}")
    return True


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Have the kernel start writing the dirty pages of bytes offset:offset+nbytes of the file
    open as `fd` to its disk, without waiting for them. Not durability: that is still the
    fsync's. False where this is unavailable (the call is then a no-op)."""
    return _sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)


def wait_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Wait until the write-back started on bytes offset:offset+nbytes has finished (the disk's
    own cache is still the fsync's to flush)."""
    _sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WAIT_BEFORE)


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
    """Whether the (untouched) page mapped at `addr` is in the page cache: mincore(2), which
    reads nothing. The kernel answers truly only for files the process owns or may write, and
    says cached for others; True where libc has no mincore or it fails."""
    vec = ctypes.c_ubyte(0)
    if not hasattr(_LIBC, "mincore") or _LIBC.mincore(addr, mmap.PAGESIZE, ctypes.byref(vec)):
        return True
    return bool(vec.value & 1)


def map_private(fd: int, start: int, length: int) -> np.ndarray:
    """Bytes start:start+length of the file open as `fd`, as a writable uint8 array [length]
    over a private (copy-on-write) map of their own: writes never reach the file nor another
    read's array. Unmapped when the last array or tensor over it is freed.

    The map goes through a new open file of the same inode, so its readahead state is its own;
    a cold first page gets one posix_fadvise(WILLNEED) over the whole range. libc's mmap, not
    Python's, whose map object holds a duplicate file descriptor while alive."""
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
