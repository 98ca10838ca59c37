"""The one write path every extraction backend's batches take: `StoredBatch` (a batch of samples'
hidden states in their stored representation: on the host, staged from the GPU, or in request
files) and `Writers`, the threads that write them into a shard at their offsets while the next
batch runs; `plan_batches` groups a shard's samples into batches. Backends (eyrie.extract.hf,
eyrie.extract.vllm_backend) import this module, never eyrie.extract.extractor, which names them.
"""

from __future__ import annotations

import queue
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from eyrie.core.errors import ExtractError

if TYPE_CHECKING:
    import torch

    from eyrie.formats.hidden_writer import ShardWriter

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
    from eyrie.formats.hidden_writer import non_finite_sample

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


class Writers:
    """Writer threads for one shard: each writes a submitted batch (StoredBatch.write), then
    releases it. A failed write surfaces at the next `submit`; besides the WRITERS being
    written, at most two batches wait for a writer (the time the backend waits: `wait_s`)."""

    def __init__(self, writer: ShardWriter):
        self.writer = writer
        self.pool = ThreadPoolExecutor(max_workers=WRITERS)
        self.pending: list[Future] = []
        self.wait_s = 0.0

    def __enter__(self) -> Writers:
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
