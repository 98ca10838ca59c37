"""The HDF5 hidden-state shard format (a contract; documented in docs/shard-format.md).

One file per tokenized shard, holding every sample of that shard back to back:

  input_ids     int32  [T]             token ids of all samples, concatenated
  loss_mask     uint8  [T]             1 on assistant tokens
  offsets       int64  [S + 1]         sample i is rows offsets[i]:offsets[i+1]
  sample_ids    str    [S]             "<file>:<line>" of each source record
  aux_hidden    STORE  [T, n_aux * H]  residual streams at aux_layer_ids, concatenated in id order
  final_hidden  STORE  [T, H]          residual stream at final_layer_id (= N, before the final norm)

STORE is uint16 holding the raw bfloat16 bit pattern when storage_dtype is "bfloat16" (h5py has
no bfloat16), else float16/float32. Datasets are contiguous and uncompressed, so one sample
reads with one slice per dataset without touching the others.

Files are written under a temporary name, validated, then renamed: a file at the final path is
always complete.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import h5py
import numpy as np
import torch

from eyrie import EyrieError
from eyrie.io import remove_stale_temporaries

FORMAT = "eyrie-hidden-states"
SCHEMA_VERSION = 1
STORAGE_DTYPES = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}
# Fields a reader compares against what the training run expects.
CHECKED_FIELDS = ("target_fingerprint", "tokenizer_hash", "aux_layer_ids", "final_layer_id",
                  "hidden_size")


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
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ShardError(f"storage_dtype {self.storage_dtype!r}: use one of {list(STORAGE_DTYPES)}")
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]


def to_storage(x: torch.Tensor, storage_dtype: str) -> np.ndarray:
    """Tensor -> numpy array in the stored representation (bf16 as its 16-bit pattern)."""
    if storage_dtype == "bfloat16":
        return x.detach().to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
    return x.detach().to(getattr(torch, storage_dtype)).cpu().contiguous().numpy()


def all_finite(a: np.ndarray, storage_dtype: str) -> bool:
    """Whether every stored value is finite (bf16 patterns: exponent bits not all ones)."""
    if storage_dtype == "bfloat16":
        return not bool(np.any((a & 0x7F80) == 0x7F80))
    return bool(np.isfinite(a).all())


def from_storage(a: np.ndarray, storage_dtype: str) -> torch.Tensor:
    if storage_dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


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
        store = STORAGE_DTYPES[meta.storage_dtype]
        f.create_dataset("input_ids", data=self.expected_ids)
        masks = np.concatenate([np.asarray(m, dtype=np.uint8) for m in loss_masks]) \
            if loss_masks else np.zeros(0, np.uint8)
        f.create_dataset("loss_mask", data=masks)
        f.create_dataset("offsets", data=self.offsets)
        f.create_dataset("sample_ids", data=np.array(sample_ids, dtype=object),
                         dtype=h5py.string_dtype())
        self.aux = f.create_dataset("aux_hidden", shape=(n_tok, n_aux * H), dtype=store)
        self.final = f.create_dataset("final_hidden", shape=(n_tok, H), dtype=store)
        attrs = asdict(meta)
        attrs["producer"] = json.dumps(meta.producer, sort_keys=True, default=str)
        attrs.update(format=FORMAT, schema_version=SCHEMA_VERSION,
                     num_samples=len(sample_ids), num_tokens=n_tok)
        for k, v in attrs.items():
            f.attrs[k] = np.asarray(v, dtype=np.int64) if k == "aux_layer_ids" else v

    def put(self, i: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        """aux: [T_i, n_aux * H]; final: [T_i, H] for sample i (any float dtype, any device)."""
        T = int(self.lengths[i])
        H, n_aux = self.meta.hidden_size, len(self.meta.aux_layer_ids)
        if tuple(aux.shape) != (T, n_aux * H) or tuple(final.shape) != (T, H):
            raise ShardError(f"{self.path}: sample {i}: got aux {tuple(aux.shape)} final "
                             f"{tuple(final.shape)}, expected ({T}, {n_aux * H}) and ({T}, {H})")
        d = self.meta.storage_dtype
        stored = {"aux_hidden": to_storage(aux, d), "final_hidden": to_storage(final, d)}
        for name, x in stored.items():
            # checked after the cast: float16 storage overflows where the compute dtype did not
            if not all_finite(x, d):
                raise ShardError(f"{self.path}: sample {i}: non-finite {name} values (compute dtype "
                                 f"or storage_dtype={d} overflows; use bfloat16 or float32)")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        self.aux[a:b] = stored["aux_hidden"]
        self.final[a:b] = stored["final_hidden"]
        self.written[i] = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
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
    for name in DATASETS:
        if name not in f:
            raise ShardError(f"{path}: dataset {name!r} missing; rebuild this shard")
    T = f["input_ids"].shape[0]
    try:
        offsets = f["offsets"][:]
    except OSError as exc:
        raise ShardError(f"{path}: offsets unreadable ({exc}); delete it and rebuild this shard") from exc
    n_aux, H = len(meta.aux_layer_ids), meta.hidden_size
    store = np.dtype(STORAGE_DTYPES[meta.storage_dtype])
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
    for ok, what in checks:
        if not ok:
            raise ShardError(f"{path}: {what} inconsistent; delete it and rebuild this shard")
    return offsets


def validate_shard(path, expected_ids: np.ndarray | None = None, check_values: bool = True) -> ShardMeta:
    """Structural checks (lengths agree, ids match, values finite); raises ShardError naming the problem."""
    with _open(path) as f:
        meta = _read_meta(f, path)
        _check_structure(f, path, meta)
        T = f["input_ids"].shape[0]
        try:
            if expected_ids is not None and not np.array_equal(f["input_ids"][:], expected_ids):
                raise ShardError(f"{path}: input_ids differ from the tokenized shard; rebuild this shard")
            if check_values:
                for name in ("aux_hidden", "final_hidden"):
                    ds = f[name]
                    step = max(1, (256 << 20) // max(1, ds.shape[1] * ds.dtype.itemsize))  # ~256 MiB
                    for a in range(0, T, step):
                        if not all_finite(ds[a:a + step], meta.storage_dtype):
                            raise ShardError(f"{path}: non-finite values in {name} rows {a}..; "
                                             "rebuild this shard")
        except OSError as exc:
            raise ShardError(f"{path}: unreadable data ({exc}); delete it and rebuild this shard") from exc
    return meta


class ShardReader:
    """Random access to samples of one shard.

    Opening checks the attrs and the structure (datasets, shapes, offsets), not every value;
    `read(i)` refuses non-finite values of the sample it reads. `expect` maps CHECKED_FIELDS to
    what the training run needs; a mismatch raises ShardError naming the field, both values and
    the fix.
    """

    def __init__(self, path, expect: dict | None = None):
        self.path = Path(path)
        self.f = _open(self.path)
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
        except BaseException:
            self.f.close()
            raise
        self.lengths = np.diff(self.offsets)
        self._ids, self._mask = self.f["input_ids"], self.f["loss_mask"]
        self._aux, self._final = self.f["aux_hidden"], self.f["final_hidden"]

    def __len__(self) -> int:
        return len(self.lengths)

    def sample_ids(self) -> list[str]:
        try:
            raw = self.f["sample_ids"][:]
        except OSError as exc:
            raise ShardError(f"{self.path}: sample_ids unreadable ({exc}); rebuild this shard") from exc
        return [s.decode() if isinstance(s, bytes) else s for s in raw]

    def read(self, i: int) -> dict[str, torch.Tensor]:
        """input_ids [T] int64, loss_mask [T] bool, aux_hidden [T, n_aux*H], final_hidden [T, H]
        (torch bfloat16/float16/float32 as stored) for sample i."""
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: sample index {i} outside 0..{len(self) - 1}")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        d = self.meta.storage_dtype
        try:
            ids, mask = self._ids[a:b], self._mask[a:b]
            aux, final = self._aux[a:b], self._final[a:b]
        except OSError as exc:  # truncated file: the header opened but the data is gone
            raise ShardError(f"{self.path}: sample {i} unreadable ({exc}); delete it and rebuild "
                             "this shard") from exc
        for name, x in (("aux_hidden", aux), ("final_hidden", final)):
            if not all_finite(x, d):
                raise ShardError(f"{self.path}: sample {i}: non-finite values in {name}; rebuild "
                                 "this shard")
        out = {
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(mask.astype(bool)),
            "aux_hidden": from_storage(aux, d),
            "final_hidden": from_storage(final, d),
        }
        return out

    def close(self):
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
