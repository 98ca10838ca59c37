"""The HDF5 hidden-state shard format (a contract; documented in docs/shard-format.md).

One file per tokenized shard, holding every sample of that shard back to back:

  input_ids     int32    [T]             token ids of all samples, concatenated
  loss_mask     uint8    [T]             1 on assistant tokens
  offsets       int64    [S + 1]         sample i is rows offsets[i]:offsets[i+1]
  sample_ids    str      [S]             "<file>:<line>" of each source record
  aux_hidden    STORE    [T, n_aux * H]  residual streams at aux_layer_ids, concatenated in id order
  final_hidden  STORE    [T, H]          residual stream at final_layer_id (= N, before the final norm)
  aux_scale     float32  [T]             float8_e4m3 only: per-token scale of aux_hidden
  final_scale   float32  [T]             float8_e4m3 only: per-token scale of final_hidden

STORE (attr storage_dtype) is uint16 holding the raw bfloat16 bit pattern for "bfloat16" (h5py
has no bfloat16), float16/float32 as such, or uint8 holding float8 e4m3fn bit patterns for
"float8_e4m3" (value = e4m3(code) * scale of its token row; scale = row amax / 448).

Hidden datasets are written contiguous and uncompressed, so the reader reads a sample by file
offset (`dataset.id.get_offset()`): zero-copy from a private memory map of its pages (reads of
MAP_MIN_BYTES and more), else by pread; other layouts (chunked, compressed: e.g. after h5repack)
are read through h5py. Values are checked finite when written; a reader checks them again per
sample read unless the caller scanned the whole shard first (`validate_shard`,
train.verify_shards).

Files are written under a temporary name, validated, then renamed: a file at the final path is
always complete.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import h5py
import numpy as np
import torch

from eyrie import EyrieError
from eyrie.io import remove_stale_temporaries

log = logging.getLogger(__name__)

FORMAT = "eyrie-hidden-states"
SCHEMA_VERSION = 1
# Fields a reader compares against what the training run expects.
CHECKED_FIELDS = ("target_fingerprint", "tokenizer_hash", "aux_layer_ids", "final_layer_id",
                  "hidden_size")
HIDDEN = ("aux_hidden", "final_hidden")
SCALES = {"aux_hidden": "aux_scale", "final_hidden": "final_scale"}
E4M3_MAX = 448.0  # largest finite float8 e4m3fn value
E4M3_INV = 1.0 / E4M3_MAX  # scales are amax times this: a multiply rounds alike on every device
SCALE_MIN = 2.0 ** -126  # smallest normal float32: the scale of an all-zero (or tiny) row
STEP_BYTES = 256 << 10  # check / dequantize this much at a time (stays in cache; measured best)
QUANTIZE_STEP_BYTES = 1 << 20  # quantize on the CPU ~1 MiB of float32 at a time
SCAN_BYTES = 64 << 20  # validate_shard reads ~64 MiB at a time
# Hidden-state reads from this size up are mapped, smaller ones copied by pread (a map, its
# faults and its unmap cost more than copying a few MiB: crossover measured at 2-4 MiB).
MAP_MIN_BYTES = 3 << 20


@dataclass(frozen=True)
class Storage:
    """How one storage_dtype is stored and checked."""
    h5: type  # numpy dtype of the hidden datasets
    bits: type  # unsigned view for the finite check
    abs_mask: int  # clears the sign bit
    non_finite: int  # (bits & abs_mask) >= non_finite: inf or NaN
    scaled: bool  # per-token float32 scales in aux_scale / final_scale


STORAGE = {
    "bfloat16": Storage(np.uint16, np.uint16, 0x7FFF, 0x7F80, False),
    "float16": Storage(np.float16, np.uint16, 0x7FFF, 0x7C00, False),
    "float32": Storage(np.float32, np.uint32, 0x7FFFFFFF, 0x7F800000, False),
    # e4m3fn has no inf; NaN is S.1111.111. read() dequantizes to float32 by default.
    "float8_e4m3": Storage(np.uint8, np.uint8, 0x7F, 0x7F, True),
}
STORAGE_DTYPES = {name: s.h5 for name, s in STORAGE.items()}
# MAP_NORESERVE (absent from Python's mmap module): no swap reserved for a private writable map
# (the default overcommit heuristic refuses one larger than RAM: measured with a 100 GB file).
MAP_NORESERVE = {"x86_64": 0x4000, "aarch64": 0x4000, "arm64": 0x4000}.get(platform.machine())


class ShardError(EyrieError):
    pass


@dataclass
class ShardMeta:
    target_fingerprint: str
    tokenizer_hash: str
    aux_layer_ids: list[int]
    final_layer_id: int
    hidden_size: int
    storage_dtype: str = "bfloat16"
    producer: dict = field(default_factory=dict)  # settings + provenance that made the shard

    def __post_init__(self):
        if self.storage_dtype not in STORAGE:
            raise ShardError(f"storage_dtype {self.storage_dtype!r}: use one of {list(STORAGE)}")
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]


def bytes_per_token(storage_dtype: str, n_states: int, hidden: int) -> int:
    """Hidden-state bytes per token: n_states (aux + final) rows of `hidden` values, plus the two
    float32 scales (aux, final) of float8_e4m3. input_ids and loss_mask add 5 more."""
    s = STORAGE[storage_dtype]
    return n_states * hidden * np.dtype(s.h5).itemsize + (2 * 4 if s.scaled else 0)


def transfer_dtype(storage_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The dtype an extraction backend hands states to ShardWriter.put in: the storage dtype,
    or for float8_e4m3 (quantized per token by put) the compute dtype, so values round once."""
    return compute if STORAGE[storage_dtype].scaled else getattr(torch, storage_dtype)


# ----------------------------------------------------------------------------- value codecs

def to_storage(x: torch.Tensor, storage_dtype: str) -> np.ndarray:
    """Tensor -> numpy array in an unscaled stored representation (bf16 as its 16-bit pattern)."""
    if storage_dtype == "bfloat16":
        return x.detach().to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
    return x.detach().to(getattr(torch, storage_dtype)).cpu().contiguous().numpy()


def quantize_e4m3_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, W] (any float dtype, any device) -> (codes uint8 [T, W] e4m3fn bit patterns,
    scale float32 [T]) on x's device, with x ~ e4m3(codes) * scale[:, None];
    scale = max(row amax * (1/448), 2^-126), codes = x * (1 / scale) rounded to nearest (even).
    A non-finite row gives a non-finite scale."""
    T, W = x.shape
    codes = torch.empty((T, W), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(T, dtype=torch.float32, device=x.device)
    step = T if x.is_cuda else max(1, QUANTIZE_STEP_BYTES // (4 * W))
    for a in range(0, T, step):
        xs = x[a:a + step].detach().to(torch.float32)  # [rows, W]
        s = (torch.linalg.vector_norm(xs, ord=float("inf"), dim=1) * E4M3_INV).clamp_(min=SCALE_MIN)
        # times the reciprocal, not divided: both are correctly rounded on a CPU and a GPU alike, so
        # codes are the same bytes wherever they are made (division kernels differ: measured)
        codes[a:a + step] = (xs * s.reciprocal()[:, None]).clamp_(-E4M3_MAX, E4M3_MAX)  # the cast rounds
        scale[a:a + step] = s
    return codes.view(torch.uint8), scale


def quantize_e4m3(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """quantize_e4m3_tensor, returned as host numpy arrays (codes uint8 [T, W], scale float32 [T])."""
    codes, scale = quantize_e4m3_tensor(x)
    return codes.cpu().numpy(), scale.cpu().numpy()


def stored_tensors(aux: torch.Tensor, final: torch.Tensor, storage_dtype: str
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The stored representation of rows, computed where they are (on the GPU, before the copy
    to the host): aux [N, n_aux*H] and final [N, H] -> ({dataset name: tensor [N, ...]} in the
    on-disk dtype (bfloat16 as int16 bit patterns, float8 as uint8 codes plus float32 scales),
    bad [N] bool: rows holding inf/NaN after the cast). ShardWriter.put_stored writes them."""
    stored: dict[str, torch.Tensor] = {}
    bad = torch.zeros(aux.shape[0], dtype=torch.bool, device=aux.device)
    for name, x in (("aux_hidden", aux), ("final_hidden", final)):
        if STORAGE[storage_dtype].scaled:
            stored[name], stored[SCALES[name]] = quantize_e4m3_tensor(x)
            s = stored[SCALES[name]]
            bad |= ~(torch.isfinite(s) & (s > 0))  # amax finite <=> row finite
        else:
            y = x.detach().to(getattr(torch, storage_dtype))
            bad |= ~torch.isfinite(y).all(dim=1)  # after the cast: float16 overflows where bf16 did not
            stored[name] = y.view(torch.int16) if storage_dtype == "bfloat16" else y
    return stored, bad


E4M3_VALUES = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn) \
    .float().numpy()  # [256] float32: the value of each code (torch's own cast; NaN at 0x7F, 0xFF)


def decode_e4m3(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., W] (e4m3fn bit patterns), scale float32 [...] -> float32 [..., W] =
    e4m3(code) * scale on the codes' device: the same values as dequantize_e4m3 (torch's float8
    cast is exact in float32, and one float32 multiply rounds alike everywhere)."""
    return codes.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)


def dequantize_e4m3(codes: np.ndarray, scale: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """codes uint8 [T, W], scale float32 [T] -> out [T, W]: float32 `e4m3(code) * scale`
    (bit-exact to torch's float8 cast times the scale), or that rounded to nearest even once
    more for a bfloat16 `out`. A table lookup and a multiply per ~256 KiB of output, in numpy:
    one thread, unlike torch's CPU ops, whose two OpenMP workers stalled ~10x whenever the
    other core was busy (measured on the shared 2-core machine)."""
    T, W = codes.shape
    if out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize_e4m3 writes float32 or bfloat16, not {out.dtype}")
    step = max(1, (STEP_BYTES // 4) // W)
    o32 = out.numpy() if out.dtype == torch.float32 else np.empty((min(step, T), W), np.float32)
    bits = None if out.dtype == torch.float32 else out.view(torch.int16).numpy().view(np.uint16)
    u = np.empty((min(step, T), W), np.uint32)
    for a in range(0, T, step):
        b = min(T, a + step)
        o = o32[a:b] if bits is None else o32[:b - a]
        np.take(E4M3_VALUES, codes[a:b], out=o)
        np.multiply(o, scale[a:b, None], out=o)
        if bits is not None:  # float32 -> bfloat16, round to nearest even: the upper 16 bits of
            v, t = o.view(np.uint32), u[:b - a]  # bits + 0x7FFF + (bit 16)
            np.right_shift(v, 16, out=t)
            np.bitwise_and(t, 1, out=t)
            t += v
            t += 0x7FFF
            np.right_shift(t, 16, out=t)
            bits[a:b] = t
    return out


def first_bad_row(a: np.ndarray, storage_dtype: str) -> int | None:
    """First row of `a` (stored values, [rows, ...]) holding inf/NaN, else None. One and + max
    per 256 KiB through a reused scratch buffer (no full-size temporaries)."""
    s = STORAGE[storage_dtype]
    if a.size == 0:
        return None
    flat = np.ascontiguousarray(a).reshape(-1).view(s.bits)
    n = max(1, STEP_BYTES // flat.itemsize)
    scratch = np.empty(min(n, flat.size), s.bits)
    for k in range(0, flat.size, n):
        part = scratch[:min(n, flat.size - k)]
        np.bitwise_and(flat[k:k + n], s.abs_mask, out=part)
        if part.max() >= s.non_finite:
            return (k + int(np.argmax(part >= s.non_finite))) // (a.size // len(a))
    return None


def all_finite(a: np.ndarray, storage_dtype: str) -> bool:
    """Whether every stored value is finite (bit patterns: exponent bits not all ones)."""
    return first_bad_row(a, storage_dtype) is None


def _bad_scale_row(scale: np.ndarray) -> int | None:
    bad = ~(np.isfinite(scale) & (scale > 0))
    return int(np.argmax(bad)) if bad.any() else None


def _libc_mmap():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
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
        self.__array_interface__ = {"data": (addr, False), "shape": (size,), "typestr": "|u1",
                                    "version": 3}

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
        addr = _LIBC.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                          mmap.MAP_PRIVATE | MAP_NORESERVE, own, base)
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
    return np.asarray(_Map(addr, size))[start - base:]


# ----------------------------------------------------------------------------- writing

class ShardWriter:
    """Preallocates a shard for known samples; `put(i, aux, final)` fills sample i.

    Use as a context manager: on a clean exit the file is validated and renamed to `path`;
    on an exception (or a sample never written) nothing appears at `path`.
    """

    def __init__(self, path, meta: ShardMeta, sample_ids: list[str],
                 input_ids: list[list[int]], loss_masks: list[list[int]]):
        if not (len(sample_ids) == len(input_ids) == len(loss_masks)):
            raise ShardError(f"{path}: sample_ids/input_ids/loss_masks lengths differ")
        self.path = Path(path)
        self.meta = meta
        self.lengths = np.array([len(x) for x in input_ids], dtype=np.int64)
        for sid, ids, mask in zip(sample_ids, input_ids, loss_masks):
            if len(ids) != len(mask):
                raise ShardError(f"{path}: sample {sid}: {len(ids)} ids but {len(mask)} mask values")
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.expected_ids = np.concatenate([np.asarray(x, dtype=np.int32) for x in input_ids]) \
            if input_ids else np.zeros(0, np.int32)
        self.written = np.zeros(len(sample_ids), dtype=bool)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.path)  # a killed writer's (SIGKILL runs no cleanup)
        self.f = h5py.File(self.tmp, "w")
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
        masks = np.concatenate([np.asarray(m, dtype=np.uint8) for m in loss_masks]) \
            if loss_masks else np.zeros(0, np.uint8)
        f.create_dataset("loss_mask", data=masks)
        f.create_dataset("offsets", data=self.offsets)
        f.create_dataset("sample_ids", data=np.array(sample_ids, dtype=object),
                         dtype=h5py.string_dtype())
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
                self.data[SCALES[name]] = f.create_dataset(SCALES[name], (n_tok,), np.float32,
                                                           dcpl=dcpl)
        attrs = asdict(meta)
        attrs["producer"] = json.dumps(meta.producer, sort_keys=True, default=str)
        attrs.update(format=FORMAT, schema_version=SCHEMA_VERSION,
                     num_samples=len(sample_ids), num_tokens=n_tok)
        for k, v in attrs.items():
            f.attrs[k] = np.asarray(v, dtype=np.int64) if k == "aux_layer_ids" else v
        # Hidden rows go straight to their datasets' file offsets (contiguous, allocated early,
        # never filled by HDF5, so no HDF5 cache holds their bytes) through a descriptor of our own.
        f.flush()
        self.raw = {name: ds.id.get_offset() for name, ds in self.data.items()}
        self.fd = os.open(self.tmp, os.O_WRONLY)

    def put(self, i: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        """aux: [T_i, n_aux * H]; final: [T_i, H] for sample i (any float dtype, any device)."""
        T = int(self.lengths[i])
        H, n_aux = self.meta.hidden_size, len(self.meta.aux_layer_ids)
        if tuple(aux.shape) != (T, n_aux * H) or tuple(final.shape) != (T, H):
            raise ShardError(f"{self.path}: sample {i}: got aux {tuple(aux.shape)} final "
                             f"{tuple(final.shape)}, expected ({T}, {n_aux * H}) and ({T}, {H})")
        d = self.meta.storage_dtype
        stored: dict[str, np.ndarray] = {}
        for name, x in (("aux_hidden", aux), ("final_hidden", final)):
            if STORAGE[d].scaled:
                stored[name], stored[SCALES[name]] = quantize_e4m3(x)
                ok = _bad_scale_row(stored[SCALES[name]]) is None  # amax finite <=> row finite
            else:
                stored[name] = to_storage(x, d)
                # checked after the cast: float16 storage overflows where the compute dtype did not
                ok = all_finite(stored[name], d)
            if not ok:
                raise ShardError(f"{self.path}: sample {i}: non-finite {name} values (compute dtype "
                                 f"or storage_dtype={d} overflows; use bfloat16 or float32)")
        self.put_stored(i, stored)

    def put_stored(self, i: int, stored: dict[str, np.ndarray]) -> None:
        """Write sample i from values already in their stored representation and already checked
        finite (`stored_tensors` on the device, copied to the host): {dataset name: [T_i, ...]}
        with the names and dtypes of this shard's hidden datasets (and scales)."""
        T = int(self.lengths[i])
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        if set(stored) != set(self.data):
            raise ShardError(f"{self.path}: sample {i}: got datasets {sorted(stored)}, expected "
                             f"{sorted(self.data)}")
        for name, x in stored.items():
            ds = self.data[name]
            if x.shape != (T, *ds.shape[1:]) or x.dtype.itemsize != ds.dtype.itemsize:
                raise ShardError(f"{self.path}: sample {i}: {name} {x.shape} {x.dtype}, expected "
                                 f"{(T, *ds.shape[1:])} {ds.dtype}")
            at = self.raw.get(name)
            if at is None:
                ds[a:b] = x.view(ds.dtype)
            else:  # the dataset's bytes at their file offset: one write, no HDF5 copy, GIL released
                row = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))
                buf = memoryview(np.ascontiguousarray(x)).cast("B")
                done = 0
                while done < len(buf):
                    done += os.pwrite(self.fd, buf[done:], at + a * row + done)
        self.written[i] = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            os.close(self.fd)
            self.f.close()
            if exc_type is None:
                missing = np.flatnonzero(~self.written)
                if len(missing):
                    raise ShardError(f"{self.path}: {len(missing)} samples never written "
                                     f"(first: index {missing[0]})")
                # put() checked every stored value; re-scanning them here would re-read the
                # whole file (measured: a quarter of the extraction time of a 1B target on a GPU)
                validate_shard(self.tmp, expected_ids=self.expected_ids, check_values=False)
                os.replace(self.tmp, self.path)
        finally:
            if self.tmp.exists():
                self.tmp.unlink()
        return False


# ----------------------------------------------------------------------------- reading

DATASETS = ("input_ids", "loss_mask", "offsets", "sample_ids", "aux_hidden", "final_hidden")


def _open(path) -> h5py.File:
    try:
        return h5py.File(path, "r")
    except OSError as exc:  # missing, truncated or corrupted file
        raise ShardError(f"{path}: unreadable HDF5 ({exc}); delete it and rebuild this shard") from exc


def _read_meta(f: h5py.File, path) -> ShardMeta:
    a = f.attrs
    if a.get("format") != FORMAT:
        raise ShardError(f"{path}: not an eyrie hidden-state shard (attr format={a.get('format')!r})")
    if int(a.get("schema_version", -1)) != SCHEMA_VERSION:
        raise ShardError(f"{path}: schema_version {a.get('schema_version')} but this eyrie reads "
                         f"{SCHEMA_VERSION}; re-extract the shard")
    fields = ("target_fingerprint", "tokenizer_hash", "aux_layer_ids", "final_layer_id",
              "hidden_size", "storage_dtype", "producer", "num_tokens")
    missing = [k for k in fields if k not in a]
    if missing:
        raise ShardError(f"{path}: attr {missing[0]!r} missing; rebuild this shard")
    try:
        return ShardMeta(
            target_fingerprint=str(a["target_fingerprint"]),
            tokenizer_hash=str(a["tokenizer_hash"]),
            aux_layer_ids=[int(i) for i in np.atleast_1d(a["aux_layer_ids"])],
            final_layer_id=int(a["final_layer_id"]),
            hidden_size=int(a["hidden_size"]),
            storage_dtype=str(a["storage_dtype"]),
            producer=json.loads(a["producer"]),
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
        raise ShardError(f"{path}: offsets unreadable ({exc}); delete it and rebuild this shard") from exc
    n_aux, H = len(meta.aux_layer_ids), meta.hidden_size
    store = np.dtype(STORAGE[meta.storage_dtype].h5)
    checks = [
        (f["loss_mask"].shape == (T,), "loss_mask length"),
        (offsets.ndim == 1 and len(offsets) == len(f["sample_ids"]) + 1, "offsets/sample_ids count"),
        (len(offsets) > 0 and offsets[0] == 0 and offsets[-1] == T
         and bool(np.all(np.diff(offsets) >= 0)), "offsets"),
        (f["aux_hidden"].shape == (T, n_aux * H), "aux_hidden shape"),
        (f["final_hidden"].shape == (T, H), "final_hidden shape"),
        (f["aux_hidden"].dtype == store and f["final_hidden"].dtype == store, "hidden dtype"),
        (f.attrs["num_tokens"] == T, "num_tokens attr"),
    ]
    if scaled:
        checks += [(f[s].shape == (T,) and f[s].dtype == np.float32, f"{s} shape/dtype")
                   for s in SCALES.values()]
    for ok, what in checks:
        if not ok:
            raise ShardError(f"{path}: {what} inconsistent; delete it and rebuild this shard")
    return offsets


def _file_offset(ds: h5py.Dataset, file_size: int) -> int | None:
    """Byte offset of a contiguous, allocated, in-file dataset; None for any other layout."""
    if ds.chunks is not None or ds.is_virtual or ds.external:
        return None
    off = ds.id.get_offset()
    if off is None or ds.id.get_storage_size() != ds.size * ds.dtype.itemsize \
            or off + ds.id.get_storage_size() > file_size:
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
                    raise ShardError(f"expect: unknown field {key!r}; use one of {list(CHECKED_FIELDS)}")
                have = getattr(self.meta, key)
                if key == "aux_layer_ids":
                    have, want = list(have), [int(i) for i in want]
                if have != want:
                    raise ShardError(f"{path}: {key} is {have!r} but the run expects {want!r}; "
                                     "re-extract this shard for the current target and layers")
            self.offsets = _check_structure(self.f, path, self.meta)
            self.storage = STORAGE[self.meta.storage_dtype]
            self._setup_access()
        except BaseException:
            self.close()
            raise
        self.lengths = np.diff(self.offsets)

    def _setup_access(self) -> None:
        """File offsets of the row datasets (None: read through h5py)."""
        names = ("input_ids", "loss_mask") + HIDDEN + (tuple(SCALES.values()) if self.storage.scaled else ())
        self._ds = {n: self.f[n] for n in names}
        # (dtype, row shape, row bytes) per dataset: h5py's properties cost ~10 us per access
        self._rowfmt = {n: (ds.dtype, ds.shape[1:], ds.dtype.itemsize * int(np.prod(ds.shape[1:])))
                        for n, ds in self._ds.items()}
        self._fd = os.open(self.path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        self._off = {n: _file_offset(ds, size) for n, ds in self._ds.items()}
        T = len(self._ds["input_ids"])
        for n, ds in self._ds.items():  # the first and last rows agree with h5py's
            if self._off[n] is not None and T and not all(
                    np.array_equal(self._rows(n, r, r + 1), ds[r:r + 1]) for r in (0, T - 1)):
                log.warning("%s: %s at file offset %d differs from h5py's read; reading it "
                            "through h5py", self.path, n, self._off[n])
                self._off[n] = None
        # "mmap": reads of MAP_MIN_BYTES and more are mapped, smaller ones copied by pread
        self.access = {n: "h5py" if o is None else "mmap" if n in HIDDEN and _LIBC is not None
                       else "pread" for n, o in self._off.items()}

    def _rows(self, name: str, a: int, b: int, mapped: bool = False,
              buf: np.ndarray | None = None) -> np.ndarray:
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
            raise ShardError(f"{self.path}: sample_ids unreadable ({exc}); rebuild this shard") from exc
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
            out = {"input_ids": torch.from_numpy(self._rows("input_ids", a, b).astype(np.int64)),
                   "loss_mask": torch.from_numpy(self._rows("loss_mask", a, b).astype(bool))}
            raw = {name: self._rows(name, a, b, mapped=True) for name in HIDDEN}
            scales = {name: self._rows(SCALES[name], a, b) for name in HIDDEN} \
                if self.storage.scaled else {}
        except OSError as exc:  # truncated file: the header opened but the data is gone
            raise ShardError(f"{self.path}: sample {i} unreadable ({exc}); delete it and rebuild "
                             "this shard") from exc
        for name in HIDDEN:
            x = raw[name]
            if self.check_values and (first_bad_row(x, d) is not None or (
                    self.storage.scaled and _bad_scale_row(scales[name]) is not None)):
                raise ShardError(f"{self.path}: sample {i}: non-finite values in {name}; rebuild "
                                 "this shard")
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
                try:  # mapped: ~1.5x the cold speed of pread on the CPU machine (read_path.py)
                    x = self._rows(name, a, b, mapped=True,
                                   buf=buf if step * row <= SCAN_BYTES else None)
                except OSError as exc:
                    raise ShardError(f"{self.path}: unreadable data ({exc}); delete it and "
                                     "rebuild this shard") from exc
                bad = _bad_scale_row(x) if name in SCALES.values() else first_bad_row(x, d)
                if bad is not None:
                    what = "non-finite or non-positive" if name in SCALES.values() else "non-finite"
                    raise ShardError(f"{self.path}: {what} values in {name} row {a + bad}; "
                                     "rebuild this shard")

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


def validate_shard(path, expected_ids: np.ndarray | None = None, check_values: bool = True) -> ShardMeta:
    """Structural checks (lengths agree, ids match, values finite); raises ShardError naming the problem."""
    with ShardReader(path, check_values=False) as r:
        try:
            if expected_ids is not None and not np.array_equal(r.f["input_ids"][:], expected_ids):
                raise ShardError(f"{path}: input_ids differ from the tokenized shard; rebuild this shard")
        except OSError as exc:
            raise ShardError(f"{path}: unreadable data ({exc}); delete it and rebuild this shard") from exc
        if check_values:
            r.scan_values()
        return r.meta
