"""The HDF5 hidden-state shard (a contract): `ShardMeta` (its attributes), `ShardReader` (random
access to samples, by file offset where the layout allows), `read_meta` and `validate_shard`; the
writer is eyrie.formats.hidden_writer. Datasets, attributes and the read path:
docs/shard-format.md.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import torch

from eyrie.core.errors import ShardError
from eyrie.formats.codecs import (
    HIDDEN,
    SCALES,
    STORAGE,
    bad_scale_row,
    dequantize_e4m3,
    first_bad_row,
)
from eyrie.formats.pagecache import _LIBC, map_private

log = logging.getLogger(__name__)


FORMAT = "eyrie-hidden-states"
SCHEMA_VERSION = 1

# Fields a reader compares against what the training run expects.
CHECKED_FIELDS = (
    "target_fingerprint",
    "tokenizer_hash",
    "aux_layer_ids",
    "final_layer_id",
    "hidden_size",
)

DATASETS = ("input_ids", "loss_mask", "offsets", "sample_ids", "aux_hidden", "final_hidden")

# What the ids and the final state mean, written into every shard so that a reader (a peer's
# trainer, another kind of draft) need not guess: vLLM's layer-id convention, the final state
# before the target's final norm. A shard without them (written before) means the same.
CONVENTIONS = {
    "layer_ids": "vllm: id k is the residual stream entering decoder layer k; id N (the layer "
    "count) is the last layer's output",
    "final_state": "before the final norm: the target's distribution is lm_head(norm(final))",
}

SCAN_BYTES = 64 << 20  # validate_shard reads ~64 MiB at a time

# Hidden-state reads from this size up are mapped (eyrie.formats.pagecache), smaller ones copied
# by pread: below it a map, its faults and its unmap cost more than the copy.
MAP_MIN_BYTES = 3 << 20


@dataclass
class ShardMeta:
    target_fingerprint: str
    tokenizer_hash: str
    aux_layer_ids: list[int]
    final_layer_id: int
    hidden_size: int
    storage_dtype: str = "bfloat16"
    producer: dict = field(default_factory=dict)  # settings + provenance that made the shard
    # made by a rehearsal (random target weights, eyrie.core.rehearsal): the attribute
    # `rehearsal` = 1, absent on a real shard
    rehearsal: bool = False

    def __post_init__(self):
        if self.storage_dtype not in STORAGE:
            raise ShardError(f"storage_dtype {self.storage_dtype!r}: use one of {list(STORAGE)}")
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]


# HDF5's own file locks (flock) stay off. A shard is complete only once renamed, so they guard
# nothing here, and a lock outlives its file's close in a child forked meanwhile: a subprocess
# started by another thread while a shard closed (the engine computing the next shard) made the
# writer's validation of its own file fail with EAGAIN.
LOCKING = False


def _open(path) -> h5py.File:
    try:
        return h5py.File(path, "r", locking=LOCKING)
    except OSError as exc:  # missing, truncated or corrupted file
        raise ShardError(
            f"{path}: unreadable HDF5 ({exc}); delete it and rebuild this shard"
        ) from exc


def _read_meta(f: h5py.File, path) -> ShardMeta:
    a = f.attrs
    if a.get("format") != FORMAT:
        raise ShardError(
            f"{path}: not an eyrie hidden-state shard (attr format={a.get('format')!r})"
        )
    if int(a.get("schema_version", -1)) != SCHEMA_VERSION:
        raise ShardError(
            f"{path}: schema_version {a.get('schema_version')} but this eyrie reads "
            f"{SCHEMA_VERSION}; re-extract the shard"
        )
    fields = (
        "target_fingerprint",
        "tokenizer_hash",
        "aux_layer_ids",
        "final_layer_id",
        "hidden_size",
        "storage_dtype",
        "producer",
        "num_tokens",
    )
    missing = [k for k in fields if k not in a]
    if missing:
        raise ShardError(f"{path}: attr {missing[0]!r} missing; rebuild this shard")
    for key, meaning in CONVENTIONS.items():
        if key in a and str(a[key]) != meaning:
            raise ShardError(
                f"{path}: attr {key!r} is {str(a[key])!r}, but eyrie reads shards whose "
                f"{key} are {meaning!r}; re-extract it with eyrie"
            )
    if "rehearsal" in a and np.asarray(a["rehearsal"]).tolist() != 1:
        raise ShardError(
            f"{path}: attr 'rehearsal' is {np.asarray(a['rehearsal']).tolist()!r}, not 1 (a "
            "rehearsal's shard) nor absent (a real one); rebuild this shard"
        )
    try:
        return ShardMeta(
            target_fingerprint=str(a["target_fingerprint"]),
            tokenizer_hash=str(a["tokenizer_hash"]),
            aux_layer_ids=[int(i) for i in np.atleast_1d(a["aux_layer_ids"])],
            final_layer_id=int(a["final_layer_id"]),
            hidden_size=int(a["hidden_size"]),
            storage_dtype=str(a["storage_dtype"]),
            producer=json.loads(a["producer"]),
            rehearsal="rehearsal" in a,
        )
    except (TypeError, ValueError) as exc:  # ShardError (bad storage_dtype) passes through
        raise ShardError(f"{path}: malformed attrs ({exc}); rebuild this shard") from exc


def _check_structure(f: h5py.File, path, meta: ShardMeta) -> np.ndarray:
    """Datasets present, shapes and offsets consistent; returns the offsets [S + 1]."""
    scaled = STORAGE[meta.storage_dtype].scaled
    for name in DATASETS + (tuple(SCALES.values()) if scaled else ()):
        if name not in f:
            raise ShardError(f"{path}: dataset {name!r} missing; rebuild this shard")
    T = f["input_ids"].shape[0]
    try:
        offsets = f["offsets"][:]
    except OSError as exc:
        raise ShardError(
            f"{path}: offsets unreadable ({exc}); delete it and rebuild this shard"
        ) from exc
    n_aux, H = len(meta.aux_layer_ids), meta.hidden_size
    store = np.dtype(STORAGE[meta.storage_dtype].h5)
    checks = [
        (f["loss_mask"].shape == (T,), "loss_mask length"),
        (
            offsets.ndim == 1 and len(offsets) == len(f["sample_ids"]) + 1,
            "offsets/sample_ids count",
        ),
        (
            len(offsets) > 0
            and offsets[0] == 0
            and offsets[-1] == T
            and bool(np.all(np.diff(offsets) >= 0)),
            "offsets",
        ),
        (f["aux_hidden"].shape == (T, n_aux * H), "aux_hidden shape"),
        (f["final_hidden"].shape == (T, H), "final_hidden shape"),
        (f["aux_hidden"].dtype == store and f["final_hidden"].dtype == store, "hidden dtype"),
        (f.attrs["num_tokens"] == T, "num_tokens attr"),
    ]
    if scaled:
        checks += [
            (f[s].shape == (T,) and f[s].dtype == np.float32, f"{s} shape/dtype")
            for s in SCALES.values()
        ]
    for ok, what in checks:
        if not ok:
            raise ShardError(f"{path}: {what} inconsistent; delete it and rebuild this shard")
    return offsets


def _file_offset(ds: h5py.Dataset, file_size: int) -> int | None:
    """Byte offset of a contiguous, allocated, in-file dataset; None for any other layout."""
    if ds.chunks is not None or ds.is_virtual or ds.external:
        return None
    off = ds.id.get_offset()
    if (
        off is None
        or ds.id.get_storage_size() != ds.size * ds.dtype.itemsize
        or off + ds.id.get_storage_size() > file_size
    ):
        return None
    return int(off)


class ShardReader:
    """Random access to samples of one shard.

    Opening checks the attrs and the structure (datasets, shapes, offsets), not every value.
    `expect` maps CHECKED_FIELDS to what the training run needs; a mismatch raises ShardError
    naming the field, both values and the fix.

    Values: with `check_values=True` (the default) `read(i)` refuses non-finite values of the
    sample it reads. `check_values=False` skips that check; use it only when every value of the
    shard was scanned before (`validate_shard(path)`, or train's verify_shards pass).
    """

    def __init__(self, path, expect: dict | None = None, check_values: bool = True):
        self.path = Path(path)
        self.check_values = check_values
        self.f = _open(self.path)
        self._fd = -1
        try:
            self.meta = _read_meta(self.f, path)
            for key, want in (expect or {}).items():
                if key not in CHECKED_FIELDS:
                    raise ShardError(
                        f"expect: unknown field {key!r}; use one of {list(CHECKED_FIELDS)}"
                    )
                have = getattr(self.meta, key)
                if key == "aux_layer_ids":
                    have, want = list(have), [int(i) for i in want]
                if have != want:
                    raise ShardError(
                        f"{path}: {key} is {have!r} but the run expects {want!r}; "
                        "re-extract this shard for the current target and layers"
                    )
            self.offsets = _check_structure(self.f, path, self.meta)
            self.storage = STORAGE[self.meta.storage_dtype]
            self._setup_access()
        except BaseException:
            self.close()
            raise
        self.lengths = np.diff(self.offsets)

    def _setup_access(self) -> None:
        """File offsets of the row datasets (None: read through h5py)."""
        names = (
            ("input_ids", "loss_mask")
            + HIDDEN
            + (tuple(SCALES.values()) if self.storage.scaled else ())
        )
        self._ds = {n: self.f[n] for n in names}
        # (dtype, row shape, row bytes) per dataset: h5py's properties are slow to ask per read
        self._rowfmt = {
            n: (ds.dtype, ds.shape[1:], ds.dtype.itemsize * int(np.prod(ds.shape[1:])))
            for n, ds in self._ds.items()
        }
        self._fd = os.open(self.path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        self._off = {n: _file_offset(ds, size) for n, ds in self._ds.items()}
        T = len(self._ds["input_ids"])
        for n, ds in self._ds.items():  # the first and last rows agree with h5py's
            if (
                self._off[n] is not None
                and T
                and not all(
                    np.array_equal(self._rows(n, r, r + 1), ds[r : r + 1]) for r in (0, T - 1)
                )
            ):
                log.warning(
                    "%s: %s at file offset %d differs from h5py's read; reading it through h5py",
                    self.path,
                    n,
                    self._off[n],
                )
                self._off[n] = None
        # "mmap": reads of MAP_MIN_BYTES and more are mapped, smaller ones copied by pread
        self.access = {
            n: "h5py" if o is None else "mmap" if n in HIDDEN and _LIBC is not None else "pread"
            for n, o in self._off.items()
        }

    def _rows(
        self, name: str, a: int, b: int, mapped: bool = False, buf: np.ndarray | None = None
    ) -> np.ndarray:
        """Rows a:b of a dataset: over a private map of their own pages when `mapped` (and
        mmap is usable), else read by pread (into `buf` when given); by h5py for a dataset
        without a file offset. OSError on failure."""
        off = self._off[name]
        if off is None or b == a:
            return self._ds[name][a:b]
        dtype, row_shape, row_bytes = self._rowfmt[name]
        shape = (b - a,) + row_shape
        start, nbytes = off + a * row_bytes, (b - a) * row_bytes
        if mapped and _LIBC is not None and nbytes >= MAP_MIN_BYTES:
            return map_private(self._fd, start, nbytes).view(dtype).reshape(shape)
        out = np.empty(shape, dtype) if buf is None else buf[:nbytes].view(dtype).reshape(shape)
        if os.preadv(self._fd, [memoryview(out).cast("B")], start) != nbytes:
            raise OSError(f"short read of {name} rows {a}:{b}")
        return out

    def __len__(self) -> int:
        return len(self.lengths)

    def sample_ids(self) -> list[str]:
        try:
            raw = self.f["sample_ids"][:]
        except OSError as exc:
            raise ShardError(
                f"{self.path}: sample_ids unreadable ({exc}); rebuild this shard"
            ) from exc
        return [s.decode() if isinstance(s, bytes) else s for s in raw]

    def read(self, i: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """input_ids [T] int64, loss_mask [T] bool, aux_hidden [T, n_aux*H], final_hidden [T, H]
        for sample i. Hidden states are in `dtype`, by default as stored (bfloat16, float16,
        float32: copy-on-write views of the file's pages where the layout allows) or float32
        (float8_e4m3, dequantized). For float8_e4m3, `dtype=torch.uint8` returns the codes as
        stored (uint8 views) plus aux_scale / final_scale float32 [T], for a decode on the GPU
        (`decode_e4m3`): a quarter of the bytes to move, and no dequantizing on the host."""
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: sample index {i} outside 0..{len(self) - 1}")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        d = self.meta.storage_dtype
        try:
            out = {
                "input_ids": torch.from_numpy(self._rows("input_ids", a, b).astype(np.int64)),
                "loss_mask": torch.from_numpy(self._rows("loss_mask", a, b).astype(bool)),
            }
            raw = {name: self._rows(name, a, b, mapped=True) for name in HIDDEN}
            scales = (
                {name: self._rows(SCALES[name], a, b) for name in HIDDEN}
                if self.storage.scaled
                else {}
            )
        except OSError as exc:  # truncated file: the header opened but the data is gone
            raise ShardError(
                f"{self.path}: sample {i} unreadable ({exc}); delete it and rebuild this shard"
            ) from exc
        for name in HIDDEN:
            x = raw[name]
            if self.check_values and (
                first_bad_row(x, d) is not None
                or (self.storage.scaled and bad_scale_row(scales[name]) is not None)
            ):
                raise ShardError(
                    f"{self.path}: sample {i}: non-finite values in {name}; rebuild this shard"
                )
            if self.storage.scaled and dtype == torch.uint8:
                t = torch.from_numpy(x)
                out[SCALES[name]] = torch.from_numpy(np.ascontiguousarray(scales[name], np.float32))
            elif self.storage.scaled:
                want = dtype or torch.float32
                direct = want if want in (torch.float32, torch.bfloat16) else torch.float32
                t = dequantize_e4m3(x, scales[name], torch.empty(x.shape, dtype=direct)).to(want)
            else:
                t = torch.from_numpy(x.view(np.int16) if d == "bfloat16" else x)
                t = t.view(torch.bfloat16) if d == "bfloat16" else t
                t = t if dtype is None else t.to(dtype)
            out[name] = t
        return out

    def scan_values(self) -> None:
        """Check every stored value (and float8 scale) of the shard, ~64 MiB at a time (mapped,
        or read into one buffer); raises ShardError naming the dataset and the first bad row."""
        d, T = self.meta.storage_dtype, len(self._ds["input_ids"])
        names = HIDDEN + (tuple(SCALES.values()) if self.storage.scaled else ())
        buf = np.empty(SCAN_BYTES, np.uint8)
        for name in names:
            row = max(1, self._rowfmt[name][2])
            step = max(1, SCAN_BYTES // row)
            for a in range(0, T, step):
                b = min(T, a + step)
                try:  # mapped, which reads cold pages faster than pread (BENCHMARKS.md)
                    x = self._rows(
                        name, a, b, mapped=True, buf=buf if step * row <= SCAN_BYTES else None
                    )
                except OSError as exc:
                    raise ShardError(
                        f"{self.path}: unreadable data ({exc}); delete it and rebuild this shard"
                    ) from exc
                bad = bad_scale_row(x) if name in SCALES.values() else first_bad_row(x, d)
                if bad is not None:
                    what = "non-finite or non-positive" if name in SCALES.values() else "non-finite"
                    raise ShardError(
                        f"{self.path}: {what} values in {name} row {a + bad}; rebuild this shard"
                    )

    def close(self):
        """Tensors handed out stay valid: each keeps its own map of the file."""
        self.f.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_meta(path) -> ShardMeta:
    """A shard's attributes alone (format and fields checked), without its datasets."""
    with _open(path) as f:
        return _read_meta(f, path)


def validate_shard(
    path, expected_ids: np.ndarray | None = None, check_values: bool = True
) -> ShardMeta:
    """Structural checks (lengths agree, ids match, values finite); raises ShardError naming the
    problem."""
    with ShardReader(path, check_values=False) as r:
        try:
            if expected_ids is not None and not np.array_equal(r.f["input_ids"][:], expected_ids):
                raise ShardError(
                    f"{path}: input_ids differ from the tokenized shard; rebuild this shard"
                )
        except OSError as exc:
            raise ShardError(
                f"{path}: unreadable data ({exc}); delete it and rebuild this shard"
            ) from exc
        if check_values:
            r.scan_values()
        return r.meta
