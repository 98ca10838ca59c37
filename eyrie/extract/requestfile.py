"""Request files: one prompt's captured states, already in their stored representation, passed
from the capture worker (eyrie.extract.capture) to the driver (eyrie.extract.vllm_backend)
through the scratch folder (in memory: /dev/shm).

The layout is safetensors' (an 8-byte header length, a JSON header, the raw bytes), so any
safetensors reader opens one. The worker writes it straight from its pinned buffer, and the shard
writer copies its rows into the shard in the kernel (sendfile): the bytes are copied once on
each side and never pass through the driver's memory. A file is named by the generate() call
that asked for it and the prompt's request key, so a prompt that recurs in the next call never
meets the last call's file.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from eyrie.core.errors import ExtractError

# numpy dtype <-> safetensors dtype name, for what a request file holds
DTYPES = {
    np.dtype(np.uint8): "U8",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.int64): "I64",
}
NUMPY = {name: dtype for dtype, name in DTYPES.items()}

# what a request file holds besides the shard's datasets (eyrie.formats.codecs.stored_tensors)
TOKEN_IDS = "token_ids"  # int64 [T]: the prompt, checked against the one the driver sent
BAD = "bad"  # uint8 [T]: stored_tensors' non-finite flags


def request_path(folder: str | Path, call: int, key: str) -> Path:
    """The file of request `key` asked for by generate() call `call`."""
    return Path(folder) / f"{call:06d}-{key}.safetensors"


def write_request(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """Write `arrays` (C-contiguous) as a safetensors file at `path`, atomically (a temporary
    name, then a rename): the driver never sees a partial file."""
    header, at = {}, 0
    for name, a in arrays.items():
        header[name] = {
            "dtype": DTYPES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [at, at + a.nbytes],
        }
        at += a.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        views = [struct.pack("<Q", len(text)), text]
        views += [memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays.values()]
        for view in views:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
    finally:
        os.close(fd)
    os.replace(tmp, path)


class RequestFile:
    """An open request file: its arrays' dtypes, shapes and byte ranges, read from its header.

    `read(name)` reads one array (the flags and token ids: small); `source(name)` is (descriptor,
    offset, bytes) of one, for the shard writer to copy in the kernel (ShardWriter.put_from_file)
    without the bytes passing through this process. The file may be removed once open; `close()`
    frees it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            size = os.fstat(self.fd).st_size
            (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            header = json.loads(os.pread(self.fd, n, 8))
            self.arrays: dict[str, tuple[np.dtype, tuple, int, int]] = {}
            for name, d in header.items():
                if name == "__metadata__":
                    continue
                dtype, (a, b) = NUMPY[d["dtype"]], d["data_offsets"]
                shape = tuple(int(x) for x in d["shape"])
                if 8 + n + b > size or b - a != dtype.itemsize * int(np.prod(shape)):
                    raise ValueError(f"{name}: bytes {a}..{b} do not hold {shape} in {size}")
                self.arrays[name] = (dtype, shape, 8 + n + a, b - a)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            os.close(self.fd)
            raise ExtractError(
                f"{self.path}: not a readable request file of the capture worker ({exc}); "
                "the engine's scratch folder was changed under it: rerun the extraction"
            ) from None

    def read(self, name: str) -> np.ndarray:
        dtype, shape, at, nbytes = self.arrays[name]
        data = os.pread(self.fd, nbytes, at)
        if len(data) != nbytes:
            raise ExtractError(f"{self.path}: {name} cut short ({len(data)} of {nbytes} bytes)")
        return np.frombuffer(data, dtype).reshape(shape)

    def source(self, name: str) -> tuple[int, int, int]:
        _, _, at, nbytes = self.arrays[name]
        return self.fd, at, nbytes

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read_request(path: str | Path) -> dict[str, np.ndarray]:
    """Every array of the request file at `path`."""
    f = RequestFile(path)
    try:
        return {name: f.read(name) for name in f.arrays}
    finally:
        f.close()
