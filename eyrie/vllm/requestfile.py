"""Request files: one prompt's captured states, already in their stored representation, passed
from the capture worker (eyrie.vllm.capture) to the driver (eyrie.vllm.backend) through the
scratch folder (in memory: /dev/shm).

The layout is safetensors' (an 8-byte header length, a JSON header, the raw bytes), so any
safetensors reader opens one. The worker writes it straight from its pinned buffer and the driver
maps it: the bytes are copied once on each side, into the scratch file and from it into the
shard. A file is named by the generate() call that asked for it and the prompt's request key, so
a prompt that recurs in the next call never meets the last call's file.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from eyrie.errors import ExtractError

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


def map_request(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of the request file at `path`, as read-only views of its mapping (they keep it
    alive: the file may be removed at once, its memory goes with the last view)."""
    try:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        (n,) = struct.unpack_from("<Q", m, 0)
        header = json.loads(bytes(m[8 : 8 + n]))
        out = {}
        for name, d in header.items():
            if name == "__metadata__":
                continue
            dtype = NUMPY[d["dtype"]]
            a, b = d["data_offsets"]
            if 8 + n + b > len(m):
                raise ValueError(f"{name} ends at byte {8 + n + b} of {len(m)}")
            view = np.frombuffer(m, dtype, (b - a) // dtype.itemsize, 8 + n + a)
            out[name] = view.reshape(d["shape"])
        return out
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise ExtractError(
            f"{path}: not a readable request file of the capture worker ({exc}); "
            "the engine's scratch folder was changed under it: rerun the extraction"
        ) from None
