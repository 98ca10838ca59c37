"""The writer of the HDF5 hidden-state shard (eyrie.formats.hidden): `ShardWriter` preallocates
a shard for known samples and writes it atomically (a file at the final path is always complete
and validated); `non_finite_sample` is its refusal of a sample holding inf/NaN. Datasets,
attributes and the write path: docs/shard-format.md.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from dataclasses import asdict
from pathlib import Path

import h5py
import numpy as np
import torch

from eyrie.core.errors import ShardError
from eyrie.core.io import remove_stale_temporaries, sync_path
from eyrie.formats.codecs import HIDDEN, SCALES, STORAGE, non_finite_dataset, stored_arrays
from eyrie.formats.hidden import (
    CONVENTIONS,
    FORMAT,
    LOCKING,
    SCHEMA_VERSION,
    ShardMeta,
    validate_shard,
)
from eyrie.formats.pagecache import start_writeback, wait_writeback

# Bytes a writer thread has written whose write-back may still be under way; past this it waits
# for its oldest ranges' write-back to finish (None: never waits). docs/shard-format.md ("Writing").
WRITEBACK_AHEAD: int | None = 256 << 20


def non_finite_sample(path: Path, i: int, name: str, storage_dtype: str) -> str:
    """The message for sample i of the shard at `path` holding inf/NaN in dataset `name`."""
    return (
        f"{path}: sample {i}: non-finite {name} values (compute dtype or "
        f"storage_dtype={storage_dtype} overflows; use bfloat16 or float32)"
    )


class ShardWriter:
    """Preallocates a shard for known samples; `put(i, aux, final)` fills sample i.

    Use as a context manager: on a clean exit the file is validated and renamed to `path`;
    on an exception (or a sample never written) nothing appears at `path`.
    """

    def __init__(
        self,
        path,
        meta: ShardMeta,
        sample_ids: list[str],
        input_ids: list[list[int]],
        loss_masks: list[list[int]],
    ):
        if not (len(sample_ids) == len(input_ids) == len(loss_masks)):
            raise ShardError(f"{path}: sample_ids/input_ids/loss_masks lengths differ")
        self.path = Path(path)
        self.meta = meta
        self.lengths = np.array([len(x) for x in input_ids], dtype=np.int64)
        for sid, ids, mask in zip(sample_ids, input_ids, loss_masks):
            if len(ids) != len(mask):
                raise ShardError(
                    f"{path}: sample {sid}: {len(ids)} ids but {len(mask)} mask values"
                )
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.expected_ids = (
            np.concatenate([np.asarray(x, dtype=np.int32) for x in input_ids])
            if input_ids
            else np.zeros(0, np.int32)
        )
        self.written = np.zeros(len(sample_ids), dtype=bool)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.path)  # a killed writer's (SIGKILL runs no cleanup)
        self.f = h5py.File(self.tmp, "w", locking=LOCKING)
        try:
            self._create(sample_ids, loss_masks)
        except BaseException:
            self.f.close()
            self.tmp.unlink(missing_ok=True)
            raise

    def _create(self, sample_ids: list[str], loss_masks: list[list[int]]) -> None:
        meta, f = self.meta, self.f
        n_tok, H, n_aux = int(self.offsets[-1]), meta.hidden_size, len(meta.aux_layer_ids)
        storage = STORAGE[meta.storage_dtype]
        f.create_dataset("input_ids", data=self.expected_ids)
        masks = (
            np.concatenate([np.asarray(m, dtype=np.uint8) for m in loss_masks])
            if loss_masks
            else np.zeros(0, np.uint8)
        )
        f.create_dataset("loss_mask", data=masks)
        f.create_dataset("offsets", data=self.offsets)
        f.create_dataset(
            "sample_ids", data=np.array(sample_ids, dtype=object), dtype=h5py.string_dtype()
        )
        # Contiguous, allocated now, never pre-filled (every row is written by put): the layout
        # the reader reads by file offset.
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        self.data = {
            "aux_hidden": f.create_dataset("aux_hidden", (n_tok, n_aux * H), storage.h5, dcpl=dcpl),
            "final_hidden": f.create_dataset("final_hidden", (n_tok, H), storage.h5, dcpl=dcpl),
        }
        if storage.scaled:
            for name in HIDDEN:
                self.data[SCALES[name]] = f.create_dataset(
                    SCALES[name], (n_tok,), np.float32, dcpl=dcpl
                )
        attrs = asdict(meta)
        attrs["producer"] = json.dumps(meta.producer, sort_keys=True, default=str)
        if attrs.pop("rehearsal"):
            attrs["rehearsal"] = 1
        attrs.update(
            format=FORMAT,
            schema_version=SCHEMA_VERSION,
            num_samples=len(sample_ids),
            num_tokens=n_tok,
            **CONVENTIONS,
        )
        for k, v in attrs.items():
            f.attrs[k] = np.asarray(v, dtype=np.int64) if k == "aux_layer_ids" else v
        # Hidden rows go straight to their datasets' file offsets (contiguous, allocated early,
        # never filled by HDF5, so no HDF5 cache holds their bytes) through a descriptor of our own.
        f.flush()
        self.raw = {name: ds.id.get_offset() for name, ds in self.data.items()}
        self.fd = os.open(self.tmp, os.O_WRONLY)
        self._local, self._fds, self._fds_lock = threading.local(), [], threading.Lock()

    def put(self, i: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        """aux: [T_i, n_aux * H]; final: [T_i, H] for sample i (any float dtype, any device)."""
        T = int(self.lengths[i])
        H, n_aux = self.meta.hidden_size, len(self.meta.aux_layer_ids)
        if tuple(aux.shape) != (T, n_aux * H) or tuple(final.shape) != (T, H):
            raise ShardError(
                f"{self.path}: sample {i}: got aux {tuple(aux.shape)} final "
                f"{tuple(final.shape)}, expected ({T}, {n_aux * H}) and ({T}, {H})"
            )
        d = self.meta.storage_dtype
        stored = stored_arrays(aux, final, d)
        name = non_finite_dataset(stored, d)
        if name is not None:
            raise ShardError(non_finite_sample(self.path, i, name, d))
        self.put_stored(i, stored)

    def put_stored(self, i: int, stored: dict[str, np.ndarray]) -> None:
        """Write sample i from values already in their stored representation and already checked
        finite (eyrie.formats.codecs): {dataset name: [T_i, ...]} with the names and dtypes of
        this shard's hidden datasets (and scales)."""
        T = int(self.lengths[i])
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        if set(stored) != set(self.data):
            raise ShardError(
                f"{self.path}: sample {i}: got datasets {sorted(stored)}, expected "
                f"{sorted(self.data)}"
            )
        for name, x in stored.items():
            ds = self.data[name]
            if x.shape != (T, *ds.shape[1:]) or x.dtype.itemsize != ds.dtype.itemsize:
                raise ShardError(
                    f"{self.path}: sample {i}: {name} {x.shape} {x.dtype}, expected "
                    f"{(T, *ds.shape[1:])} {ds.dtype}"
                )
            at = self.raw.get(name)
            if at is None:
                ds[a:b] = x.view(ds.dtype)
            else:  # the dataset's bytes at their file offset: one write, no HDF5 copy, GIL released
                row = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))
                buf = memoryview(np.ascontiguousarray(x)).cast("B")
                done = 0
                while done < len(buf):
                    done += os.pwrite(self.fd, buf[done:], at + a * row + done)
                self._written(self.fd, at + a * row, len(buf))
        self.written[i] = True

    def put_from_file(self, i: int, sources: dict[str, tuple[int, int, int]]) -> None:
        """Write sample i from bytes already in their stored representation and already checked
        finite, lying in other files: {dataset name: (descriptor, offset, bytes)}. The kernel
        copies them (sendfile, through a descriptor of this thread's own), so they never pass
        through this process's memory."""
        T = int(self.lengths[i])
        a = int(self.offsets[i])
        if set(sources) != set(self.data):
            raise ShardError(
                f"{self.path}: sample {i}: got datasets {sorted(sources)}, expected "
                f"{sorted(self.data)}"
            )
        out = self._thread_fd()
        for name, (fd, at, nbytes) in sources.items():
            ds = self.data[name]
            row = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))
            if nbytes != T * row:
                raise ShardError(
                    f"{self.path}: sample {i}: {name} has {nbytes} bytes, expected {T * row} "
                    f"({T} rows of {row})"
                )
            os.lseek(out, self.raw[name] + a * row, os.SEEK_SET)
            done = 0
            while done < nbytes:
                sent = os.sendfile(out, fd, at + done, nbytes - done)
                if sent == 0:
                    raise ShardError(f"{self.path}: sample {i}: {name}: its source ended early")
                done += sent
            self._written(out, self.raw[name] + a * row, nbytes)
        self.written[i] = True

    def _written(self, fd: int, at: int, nbytes: int) -> None:
        """Start the write-back of bytes at:at+nbytes, just written, so that the fsync before
        the rename has little left; past WRITEBACK_AHEAD bytes of this thread's, wait for its
        oldest ranges. Durability stays the fsync's (no-op where unavailable)."""
        if not start_writeback(fd, at, nbytes) or WRITEBACK_AHEAD is None:
            return
        local = self._local
        if not hasattr(local, "pending"):
            local.pending, local.ahead = deque(), 0
        local.pending.append((fd, at, nbytes))
        local.ahead += nbytes
        while local.ahead > WRITEBACK_AHEAD:
            old = local.pending.popleft()
            wait_writeback(*old)
            local.ahead -= old[2]

    def _thread_fd(self) -> int:
        """This thread's own descriptor of the file (sendfile writes at a descriptor's position)."""
        fd = getattr(self._local, "fd", None)
        if fd is None:
            fd = self._local.fd = os.open(self.tmp, os.O_WRONLY)
            with self._fds_lock:
                self._fds.append(fd)
        return fd

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            for fd in self._fds:
                os.close(fd)
            os.close(self.fd)
            self.f.close()
            if exc_type is None:
                missing = np.flatnonzero(~self.written)
                if len(missing):
                    raise ShardError(
                        f"{self.path}: {len(missing)} samples never written "
                        f"(first: index {missing[0]})"
                    )
                # every stored value was checked before it was written; a re-scan would re-read
                # the whole file
                validate_shard(self.tmp, expected_ids=self.expected_ids, check_values=False)
                sync_path(self.tmp)  # on disk before its name says it is complete
                os.replace(self.tmp, self.path)
                sync_path(self.path.parent)
        finally:
            if self.tmp.exists():
                self.tmp.unlink()
        return False
