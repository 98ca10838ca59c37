"""Extraction of target hidden states into HDF5 shards: `Extractor` (one target load, many
shards) and the one write path every backend's batches take.

`Extractor(target, preflight, settings)` checks the settings, the target and its preflight
report, then opens the backend named by `extract.backend` (`BACKENDS`: the one model load);
`extract(shard, out)` writes one shard per call. Every backend yields `StoredBatch`es, which
writer threads turn into stored rows and write at their file offsets while the next batch runs.
docs/extraction.md (the engine and its clients), docs/shard-format.md ("Extraction").
"""

from __future__ import annotations

import importlib
import logging
import queue
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import numpy as np

from eyrie.arch.target import inspect_target, resolve_layer_ids, tokenizer_hash
from eyrie.errors import ExtractError
from eyrie.formats.tokenized import Tokenized, read_tokenized
from eyrie.io import provenance
from eyrie.rehearsal import is_rehearsal
from eyrie.runtime import auto_device, auto_dtype
from eyrie.settings import load_settings

if TYPE_CHECKING:
    import torch

    from eyrie.formats.hidden import ShardMeta, ShardWriter

log = logging.getLogger(__name__)


# backend name -> "module:Class", imported only when chosen (vLLM is not installed everywhere)
BACKENDS = {"hf": "eyrie.extract.hf:HFBackend", "vllm": "eyrie.vllm.backend:VllmBackend"}

PROGRESS_EVERY_S = 5.0

# writer threads: writes at file offsets release the GIL, and one thread's page-cache writes
# are slower than a GPU's hidden states of a shallow wide target
WRITERS = 4

# Shapes of one sample's states: (aux [T_i, n_aux*H], final [T_i, H])
Shapes = tuple[tuple[int, ...], tuple[int, ...]]


class StoredBatch(ABC):
    """What every backend yields: samples `batch` (indices into the shard) and their hidden
    states, written into the shard by a writer thread (`write`), then `release()`d.

    `shapes[j]` (aux, final) of sample batch[j] is known at once, before the values.
    """

    batch: list[int]
    shapes: list[Shapes]

    @abstractmethod
    def write(self, writer: ShardWriter) -> None:
        """Write every sample at its file offset; raise at the first holding a non-finite
        value, naming the sample and the dataset."""

    def release(self) -> None:
        """Free what holds the values (called once per batch, written or not)."""


@dataclass
class HostBatch(StoredBatch):
    """States on the host, CPU tensors in `transfer_dtype`: aux[j] [T_i, n_aux*H] and final[j]
    [T_i, H] of sample batch[j]. The writer thread converts them (ShardWriter.put), so the
    conversion overlaps the backend's next batch."""

    batch: list[int]
    aux: list[torch.Tensor]
    final: list[torch.Tensor]

    def __post_init__(self):
        if not len(self.batch) == len(self.aux) == len(self.final):
            raise ExtractError(
                f"extraction backend: a batch of {len(self.batch)} samples came with "
                f"{len(self.aux)} aux and {len(self.final)} final tensors"
            )
        self.shapes = [(tuple(a.shape), tuple(f.shape)) for a, f in zip(self.aux, self.final)]

    def write(self, writer: ShardWriter) -> None:
        for i, a, f in zip(self.batch, self.aux, self.final):
            writer.put(i, a, f)


@dataclass
class StagedBatch(StoredBatch):
    """Rows already in the stored representation (stored_tensors on the GPU), copied or still
    being copied into a pinned host buffer. `rows[j]`: {dataset name: numpy [T_i, ...]} of
    sample batch[j] (views into the buffer); `bad`: [N] flags of stored_tensors. Both hold
    their values once the `done` event (if any) has passed; `free` hands the buffer back."""

    batch: list[int]
    lengths: list[int]
    rows: list[dict[str, np.ndarray]]
    bad: np.ndarray
    done: torch.cuda.Event | None
    free: Callable[[], None]

    def __post_init__(self):
        self.shapes = [(r["aux_hidden"].shape, r["final_hidden"].shape) for r in self.rows]

    def write(self, writer: ShardWriter) -> None:
        if self.done is not None:
            self.done.synchronize()
        refuse_bad_rows(writer, self.batch, self.lengths, self.bad)
        for i, rows in zip(self.batch, self.rows):
            writer.put_stored(i, rows)

    def release(self) -> None:
        self.free()


@dataclass
class FileBatch(StoredBatch):
    """Rows already in the stored representation, lying in other files (a capture worker's
    request files): `sources[j]` {dataset name: (descriptor, offset, bytes)} of sample batch[j],
    copied into the shard by the kernel (ShardWriter.put_from_file); `shapes[j]` as the files
    say; `bad`: [N] flags of stored_tensors; `free` closes the files."""

    batch: list[int]
    lengths: list[int]
    sources: list[dict[str, tuple[int, int, int]]]
    shapes: list[Shapes]
    bad: np.ndarray
    free: Callable[[], None]

    def write(self, writer: ShardWriter) -> None:
        refuse_bad_rows(writer, self.batch, self.lengths, self.bad)
        for i, sources in zip(self.batch, self.sources):
            writer.put_from_file(i, sources)

    def release(self) -> None:
        self.free()


def refuse_bad_rows(writer: ShardWriter, batch: list[int], lengths: list[int], bad) -> None:
    """Raise, naming the first sample and dataset, where stored_tensors' flags `bad` [N] (of
    the batch's rows, in batch order) mark a non-finite row."""
    from eyrie.formats.codecs import HIDDEN
    from eyrie.formats.hidden import non_finite_sample

    if not bad.any():
        return
    bounds = np.cumsum(lengths)
    j = int(np.searchsorted(bounds, int(np.argmax(bad != 0)), side="right"))
    flags = np.bitwise_or.reduce(bad[bounds[j] - lengths[j] : bounds[j]])
    name = HIDDEN[0] if flags & 1 else HIDDEN[1]  # aux first, as ShardWriter.put checks
    storage_dtype = writer.meta.storage_dtype
    raise ExtractError(non_finite_sample(writer.path, batch[j], name, storage_dtype))


class PinnedStaging:
    """A few pinned host buffers, reused: `stage` copies a batch's stored rows from the GPU into a
    free one without blocking the host (it waits only when every buffer still awaits its write:
    the writer's back-pressure, counted in `wait_s`)."""

    ALIGN = 256

    def __init__(self, slots: int = 3):
        self.free: queue.Queue = queue.Queue()
        for _ in range(slots):
            self.free.put(None)  # allocated at first use, at the size the batches need
        self.wait_s = 0.0

    def stage(
        self,
        batch: list[int],
        lengths: list[int],
        stored: dict[str, torch.Tensor],
        bad: torch.Tensor,
    ) -> StagedBatch:
        """stored, bad: of stored_tensors, on the device ([N, ...], N = sum(lengths), samples in
        batch order)."""
        import torch

        parts = [*stored.items(), ("bad", bad.view(torch.uint8))]
        sizes = [-(-x.numel() * x.element_size() // self.ALIGN) * self.ALIGN for _, x in parts]
        buf = self._buffer(sum(sizes))
        host, at = {}, 0
        for (name, x), size in zip(parts, sizes):
            view = buf[at : at + x.numel() * x.element_size()].view(x.dtype).view(x.shape)
            view.copy_(x, non_blocking=True)
            host[name] = view.numpy()
            at += size
        done = torch.cuda.Event()
        done.record()
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        rows = [{name: host[name][a:b] for name in stored} for a, b in zip(bounds[:-1], bounds[1:])]
        return StagedBatch(
            list(batch),
            list(lengths),
            rows,
            host["bad"],
            done,
            free=lambda: self.free.put(buf),
        )

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A free buffer of at least `nbytes` (waits for one; grows it for a larger batch)."""
        import torch

        t = time.monotonic()
        buf = self.free.get()
        self.wait_s += time.monotonic() - t
        if buf is None or buf.numel() < nbytes:
            del buf  # a larger batch than before (a long sample alone): grow this slot
            buf = torch.empty(int(nbytes * 1.25), dtype=torch.uint8, pin_memory=True)
        return buf


@dataclass(frozen=True)
class ExtractSettings:
    backend: str
    device: str  # resolved: cpu | cuda
    dtype: torch.dtype  # compute dtype (resolved)
    storage_dtype: str  # bfloat16 | float16 | float32 | float8_e4m3
    max_tokens_per_batch: int
    aux_ids: list[int] | None
    trust_remote_code: bool
    # the config's vllm section, untouched (the vllm backend checks it)
    vllm: dict = field(default_factory=dict)


class Backend(Protocol):
    """What a backend provides. The constructor is the (one) model load: `Backend(target: Path,
    info: TargetInfo, cfg: ExtractSettings, aux_ids: list[int], final_id: int)`."""

    def states(self, input_ids: list[np.ndarray], storage: torch.dtype) -> Iterator[StoredBatch]:
        """Hidden states of every sample of `input_ids` (token ids int32 [T_i] each), batch after
        batch, each sample exactly once; host tensors travel in the `storage` dtype
        (transfer_dtype)."""

    def close(self) -> None:
        """Release the model (GPU memory, worker processes)."""


def parse_settings(settings: dict) -> ExtractSettings:
    """The stage's settings, checked by the schema (every problem at once, each naming its key),
    with the autos resolved."""
    import torch

    # the vllm backend reads the config's vllm section: with it, --settings must carry one
    ext, problems = settings.get("extract"), []
    if isinstance(ext, dict) and ext.get("backend") == "vllm" and not settings.get("vllm"):
        problems.append(
            "extract.backend=vllm but --settings has no vllm section; pass the config's "
            "vllm section"
        )
    if is_rehearsal(settings) and isinstance(ext, dict) and ext.get("backend") != "vllm":
        problems.append(
            f"vllm.rehearsal: true but extract.backend is {ext.get('backend')!r}: only the vllm "
            "backend builds the target with random weights; set extract.backend: vllm"
        )
    loaded = load_settings(settings, ["extract", "layers"], ExtractError, problems)
    ext, vllm = loaded["extract"], loaded.get("vllm") or {}
    device = auto_device("extract.device", ext["device"], ExtractError)
    dtype = auto_dtype(ext["dtype"], device)
    return ExtractSettings(
        backend=ext["backend"],
        device=device,
        dtype=getattr(torch, dtype),
        storage_dtype=ext["storage_dtype"],
        max_tokens_per_batch=ext["max_tokens_per_batch"],
        aux_ids=loaded["layers"]["aux_ids"],
        trust_remote_code=loaded["trust_remote_code"],
        vllm=vllm,
    )


def backend_class(name: str) -> type:
    """The backend registered as `name` in BACKENDS (imported now)."""
    if name not in BACKENDS:
        raise ExtractError(f"extract.backend={name!r}: use one of {list(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise ExtractError(
            f"extract.backend={name!r}: cannot import {BACKENDS[name]} ({exc}); "
            "install what it needs in this environment or use extract.backend hf"
        ) from exc


def plan_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Sort samples by length (longest first) and group them so that each batch's padded size
    (len(batch) * longest) is at most `max_tokens`. A sample longer than `max_tokens` forms a
    batch of its own (it is never split: that would change its hidden states)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        # the first sample of a batch is its longest: padded size = count * that length
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class Extractor:
    """One target load, many shards.

    The constructor checks the settings, the target and its preflight report, then opens the
    backend (the one model load); `extract(shard, out)` writes one HDF5 shard per call.
    """

    def __init__(self, target: str | Path, preflight: str | Path, settings: dict):
        self.target, self.settings = Path(target), settings
        self.cfg = parse_settings(settings)
        self.info = inspect_target(target)
        from eyrie.formats.report import read_report

        read_report(preflight, self.info.fingerprint)
        self.aux_ids, self.final_id = resolve_layer_ids(
            self.cfg.aux_ids, self.info.num_hidden_layers
        )
        self.tokenizer_hash = tokenizer_hash(target)
        cls = backend_class(self.cfg.backend)
        t0 = time.monotonic()
        self.backend: Backend = cls(self.target, self.info, self.cfg, self.aux_ids, self.final_id)
        self.load_s = time.monotonic() - t0
        log.info(
            "loaded target %s (%s backend) in %.1f s: aux ids %s, final id %d",
            target,
            self.cfg.backend,
            self.load_s,
            self.aux_ids,
            self.final_id,
        )

    def __enter__(self) -> Extractor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.backend.close()

    def extract(
        self, shard: str | Path, out: str | Path, tokenized: Tokenized | None = None
    ) -> Path:
        """Extract the hidden states of every sample of `shard` into the HDF5 shard `out`
        (`tokenized`: the shard already read by read_tokenized, to skip reading it again)."""
        import torch

        from eyrie.formats.codecs import transfer_dtype
        from eyrie.formats.hidden import ShardWriter

        sample_ids, input_ids, loss_masks = tokenized or read_tokenized(shard, self.info.vocab_size)
        lengths = [len(x) for x in input_ids]
        log.info(
            "extract %s: %d samples, %d tokens, aux ids %s, final id %d -> %s %s",
            shard,
            len(lengths),
            sum(lengths),
            self.aux_ids,
            self.final_id,
            out,
            self.cfg.storage_dtype,
        )
        storage = transfer_dtype(self.cfg.storage_dtype, self.cfg.dtype)
        progress = _Progress(lengths)
        with (
            ShardWriter(out, self._meta(), sample_ids, input_ids, loss_masks) as writer,
            _Writers(writer) as writers,
            torch.inference_mode(),
        ):
            for item in self.backend.states(input_ids, storage):
                try:
                    self._check(item, lengths)
                except BaseException:
                    item.release()  # the backend's buffers outlive this shard
                    raise
                writers.submit(item)
                progress.add(item.batch)
            writers.join()
        self.write_wait_s = writers.wait_s  # the benchmark's breakdown reads it
        progress.wrote(out, writers.wait_s, self.load_s)
        return Path(out)

    def _meta(self) -> ShardMeta:
        from eyrie.formats.hidden import ShardMeta

        return ShardMeta(
            target_fingerprint=self.info.fingerprint,
            tokenizer_hash=self.tokenizer_hash,
            aux_layer_ids=self.aux_ids,
            final_layer_id=self.final_id,
            hidden_size=self.info.hidden_size,
            storage_dtype=self.cfg.storage_dtype,
            producer={"settings": self.settings, "provenance": provenance(self.settings)},
            rehearsal=is_rehearsal(self.settings),
        )

    def _check(self, item: StoredBatch, lengths: list[int]) -> None:
        """A backend's batch: per sample aux [T_i, n_aux*H] and final [T_i, H]."""
        H, n_aux = self.info.hidden_size, len(self.aux_ids)
        for i, (a, f) in zip(item.batch, item.shapes):
            if tuple(f[1:]) != (H,) or tuple(a[1:]) != (n_aux * H,):
                raise ExtractError(
                    f"{self.target}: captured hidden size {f[-1]} (aux "
                    f"{a[-1]}) but config.json says hidden_size={H} "
                    f"({n_aux} aux layers: {n_aux * H})"
                )
            if f[0] != lengths[i] or a[0] != lengths[i]:
                raise ExtractError(
                    f"backend {self.cfg.backend}: sample {i} has {lengths[i]} tokens "
                    f"but {f[0]} final / {a[0]} aux rows"
                )


class _Writers:
    """Writer threads for one shard: each writes a submitted batch (StoredBatch.write), then
    releases it. A failed write surfaces at the next `submit`; besides the WRITERS being
    written, at most two batches wait for a writer (the time the backend waits: `wait_s`)."""

    def __init__(self, writer: ShardWriter):
        self.writer = writer
        self.pool = ThreadPoolExecutor(max_workers=WRITERS)
        self.pending: list[Future] = []
        self.wait_s = 0.0

    def __enter__(self) -> _Writers:
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True)  # a failed shard: the writes under way end first

    def submit(self, item: StoredBatch) -> None:
        self.pending.append(self.pool.submit(self._write, item))
        while self.pending and (self.pending[0].done() or len(self.pending) > WRITERS + 2):
            self._result(self.pending.pop(0))

    def join(self) -> None:
        """Wait for every write; re-raises a failed one."""
        while self.pending:
            self._result(self.pending.pop(0))

    def _result(self, job: Future) -> None:
        t = time.monotonic()
        job.result()  # re-raises a failed write
        self.wait_s += time.monotonic() - t

    def _write(self, item: StoredBatch) -> None:
        try:
            item.write(self.writer)
        finally:
            item.release()


class _Progress:
    """Samples and tokens done for one shard: a log line every PROGRESS_EVERY_S, and the last."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths
        self.samples = self.tokens = 0
        self.start = self.last_log = time.monotonic()

    def add(self, batch: list[int]) -> None:
        self.samples += len(batch)
        self.tokens += sum(self.lengths[i] for i in batch)
        now = time.monotonic()
        if now - self.last_log >= PROGRESS_EVERY_S:
            log.info(
                "%d/%d samples, %d tokens, %.0f tokens/s",
                self.samples,
                len(self.lengths),
                self.tokens,
                self.tokens / (now - self.start),
            )
            self.last_log = now

    def wrote(self, out: str | Path, write_wait_s: float, load_s: float) -> None:
        elapsed = time.monotonic() - self.start
        log.info(
            "wrote %s: %d samples, %d tokens in %.1f s (%.0f tokens/s; waiting for writes "
            "%.1f s; target loaded once in %.1f s)",
            out,
            len(self.lengths),
            sum(self.lengths),
            elapsed,
            sum(self.lengths) / max(elapsed, 1e-9),
            write_wait_s,
            load_s,
        )


def extract_shard(
    target: str | Path, shard: str | Path, preflight: str | Path, out: str | Path, settings: dict
) -> Path:
    """Extract `shard` into `out` with a model load of its own (standalone `eyrie extract`).

    The settings and the shard are checked before the load, so a bad shard fails in seconds."""
    parse_settings(settings)
    tokenized = read_tokenized(shard, inspect_target(target).vocab_size)
    with Extractor(target, preflight, settings) as extractor:
        return extractor.extract(shard, out, tokenized=tokenized)
