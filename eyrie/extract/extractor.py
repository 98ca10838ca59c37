"""`eyrie extract`: target hidden states of tokenized shards into HDF5 shards.

One model load serves many shards: `Extractor` checks the settings, the target and the preflight
report and opens a backend (the one load), then `extract(shard, out)` writes one HDF5 shard per
call. `eyrie extract` runs one Extractor for one shard (standalone), or with `--engine SOCKET`
sends its shard to a running `eyrie extract-engine` that holds the loaded target (eyrie.extract.engine;
docs/extraction.md).

A backend yields hidden states; the writer path here is shared by all backends. Backend "hf": a
Hugging Face transformers forward of the target's base model (no lm_head, so no logits) with
hooks that capture the residual stream in vLLM layer-id semantics (eyrie.arch.hooks): aux ids k
(stream entering layer k) and id N (last layer output, before the final norm). Samples are sorted
by length and packed into right-padded batches of at most `extract.max_tokens_per_batch` padded
tokens. Writing to HDF5 runs in a background thread so it overlaps the next forward pass.

On a GPU the host never waits for the device within a batch: the real (unpadded) rows are cast to
their stored representation (bfloat16 bits, or float8 codes and scales) and checked finite on the
GPU, then copied without blocking into one of a few pinned host buffers (`PinnedStaging`); the
writer thread waits for that copy, writes each sample at its file offset and hands the buffer
back, while the main thread already runs the next batch's forward pass.

torch, pyarrow and h5py are imported where they are used: the `--engine` client path imports
none of them (a group of shard clients then costs a few MB each, not ~250 MB).
"""

from __future__ import annotations

import importlib
import logging
import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import numpy as np

from eyrie.arch.target import (
    inspect_target,
    resolve_layer_ids,
    tokenizer_hash,
)
from eyrie.errors import ExtractError
from eyrie.formats.tokenized import Tokenized, read_tokenized
from eyrie.io import provenance

if TYPE_CHECKING:
    import torch

    from eyrie.formats.hidden import ShardWriter
log = logging.getLogger(__name__)


DEVICES = ("auto", "cpu", "cuda")


DTYPES = ("auto", "bfloat16", "float16", "float32")


# backend name -> "module:Class", imported only when chosen (vLLM is not installed everywhere)
BACKENDS = {"hf": "eyrie.extract.hf:HFBackend", "vllm": "eyrie.vllm.backend:VllmBackend"}


PROGRESS_EVERY_S = 5.0


# writer threads: writes at file offsets release the GIL, and one thread's page-cache writes
# (~2 GB/s) are slower than a GPU's hidden states of a shallow wide target
WRITERS = 4


# (sample indices, aux [T_i, n_aux*H] per sample, final [T_i, H] per sample), CPU, storage dtype
States = tuple[list[int], list["torch.Tensor"], list["torch.Tensor"]]


@dataclass
class StagedBatch:
    """A batch in its stored representation, copied (or still being copied) from the GPU into a
    pinned host buffer. `rows[j]`: {dataset name: numpy [T_i, ...]} of sample batch[j] (views into
    the buffer); `bad`: [N] host flags of non-finite rows, valid after `wait()`."""

    batch: list[int]
    lengths: list[int]
    rows: list[dict[str, np.ndarray]]
    bad: np.ndarray
    done: "torch.cuda.Event"
    release: "Callable[[], None]"

    def wait(self, out: Path) -> None:
        """Block until the copy has landed; raise if a row is not finite (storage overflow)."""
        self.done.synchronize()
        if self.bad.any():
            row = int(np.argmax(self.bad))
            j = int(np.searchsorted(np.cumsum(self.lengths), row, side="right"))
            raise ExtractError(
                f"{out}: sample {self.batch[j]}: non-finite hidden states (compute "
                "dtype or storage_dtype overflows; use bfloat16 or float32)"
            )


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
        """stored: {name: device tensor [N, ...]} (N = sum(lengths), samples in batch order)."""
        import torch

        t = time.monotonic()
        buf = self.free.get()
        self.wait_s += time.monotonic() - t
        parts = [*stored.items(), ("bad", bad.view(torch.uint8))]
        sizes = [-(-x.numel() * x.element_size() // self.ALIGN) * self.ALIGN for _, x in parts]
        if buf is None or buf.numel() < sum(sizes):
            del buf  # a larger batch than before (a long sample alone): grow this slot
            buf = torch.empty(int(sum(sizes) * 1.25), dtype=torch.uint8, pin_memory=True)
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
            batch, list(lengths), rows, host["bad"].view(bool), done, lambda: self.free.put(buf)
        )


@dataclass(frozen=True)
class ExtractSettings:
    backend: str
    device: str  # resolved: cpu | cuda
    dtype: torch.dtype  # compute dtype (resolved)
    storage_dtype: str  # bfloat16 | float16 | float32 | float8_e4m3
    max_tokens_per_batch: int
    aux_ids: list[int] | None
    trust_remote_code: bool
    vllm: dict = field(
        default_factory=dict
    )  # the vllm section, untouched (the vllm backend checks it)


class Backend(Protocol):
    """What a backend provides. The constructor is the (one) model load:
    `Backend(target: Path, info: TargetInfo, cfg: ExtractSettings, aux_ids: list[int], final_id: int)`.
    """

    def states(self, input_ids: list[np.ndarray], storage: torch.dtype) -> Iterator[States]:
        """Hidden states of every sample of `input_ids` (token ids int32 [T_i] each), batch after
        batch, each sample exactly once: as CPU tensors in the `storage` dtype (States), or as a
        StagedBatch already in the stored representation (the HF backend on a GPU)."""

    def close(self) -> None:
        """Release the model (GPU memory, worker processes)."""


def parse_settings(settings: dict) -> ExtractSettings:
    """Check the stage's settings (every problem at once, each naming its key) and resolve autos."""
    import torch

    from eyrie.formats.codecs import STORAGE_DTYPES

    problems = []
    ext = settings.get("extract")
    if not isinstance(ext, dict):
        raise ExtractError(
            "--settings: key 'extract' missing or not an object; pass the config's extract section"
        )
    allowed = {
        "backend": tuple(BACKENDS),
        "device": DEVICES,
        "dtype": DTYPES,
        "storage_dtype": tuple(STORAGE_DTYPES),
    }
    for key, choices in allowed.items():
        if ext.get(key) not in choices:
            problems.append(f"extract.{key}={ext.get(key)!r}: use one of {list(choices)}")
    mtpb = ext.get("max_tokens_per_batch")
    if not isinstance(mtpb, int) or isinstance(mtpb, bool) or mtpb < 1:
        problems.append(f"extract.max_tokens_per_batch={mtpb!r}: use a positive integer")
    # the config's top-level vllm section (the vllm backend checks its contents)
    vllm = settings.get("vllm") or {}
    if not isinstance(vllm, dict):
        problems.append(f"vllm={vllm!r}: use the config's vllm section (a mapping)")
    elif ext.get("backend") == "vllm" and not vllm:
        problems.append(
            "extract.backend=vllm but --settings has no vllm section; pass the "
            "config's vllm section"
        )
    layers = settings.get("layers")
    aux = layers.get("aux_ids") if isinstance(layers, dict) else "missing"
    if not (aux is None or (isinstance(aux, list) and all(isinstance(i, int) for i in aux))):
        problems.append(f"layers.aux_ids={aux!r}: use null or a list of integers")
    trc = settings.get("trust_remote_code", False)
    if not isinstance(trc, bool):
        problems.append(f"trust_remote_code={trc!r}: use true or false")
    if problems:
        raise ExtractError("invalid --settings: " + "; ".join(problems))

    device = ext["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ExtractError(
            "extract.device=cuda but no CUDA device is visible; run on a GPU node "
            "or set extract.device to auto/cpu"
        )
    dtype = ext["dtype"]
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return ExtractSettings(
        backend=ext["backend"],
        device=device,
        dtype=getattr(torch, dtype),
        storage_dtype=ext["storage_dtype"],
        max_tokens_per_batch=mtpb,
        aux_ids=aux,
        trust_remote_code=trc,
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
        from eyrie.formats.hidden import ShardMeta, ShardWriter

        sample_ids, input_ids, loss_masks = tokenized or read_tokenized(shard, self.info.vocab_size)
        meta = ShardMeta(
            target_fingerprint=self.info.fingerprint,
            tokenizer_hash=self.tokenizer_hash,
            aux_layer_ids=self.aux_ids,
            final_layer_id=self.final_id,
            hidden_size=self.info.hidden_size,
            storage_dtype=self.cfg.storage_dtype,
            producer={"settings": self.settings, "provenance": provenance(self.settings)},
        )
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
        # float8_e4m3: states arrive in the compute dtype and ShardWriter.put quantizes them
        storage = transfer_dtype(self.cfg.storage_dtype, self.cfg.dtype)
        start = last_log = time.monotonic()
        write_wait_s = 0.0
        done_samples = done_tokens = 0
        with (
            ShardWriter(out, meta, sample_ids, input_ids, loss_masks) as writer,
            ThreadPoolExecutor(max_workers=WRITERS) as pool,
            torch.inference_mode(),
        ):
            pending: list[Future] = []
            for item in self.backend.states(input_ids, storage):
                if isinstance(item, StagedBatch):
                    batch = item.batch
                    try:
                        self._check_staged(item, lengths)
                    except BaseException:
                        item.release()  # the backend's buffers outlive this shard
                        raise
                    job = pool.submit(_write_staged, writer, item, Path(out))
                else:
                    batch, aux, final = item
                    self._check(batch, aux, final, lengths)
                    job = pool.submit(_write_batch, writer, batch, aux, final)
                pending.append(job)
                # a failed write surfaces at once; at most two batches wait for the writer
                while pending and (pending[0].done() or len(pending) > 2):
                    t = time.monotonic()
                    pending.pop(0).result()  # re-raises a failed write
                    write_wait_s += time.monotonic() - t
                done_samples += len(batch)
                done_tokens += sum(lengths[i] for i in batch)
                now = time.monotonic()
                if now - last_log >= PROGRESS_EVERY_S:
                    log.info(
                        "%d/%d samples, %d tokens, %.0f tokens/s",
                        done_samples,
                        len(lengths),
                        done_tokens,
                        done_tokens / (now - start),
                    )
                    last_log = now
            t = time.monotonic()
            for job in pending:
                job.result()
            write_wait_s += time.monotonic() - t
        elapsed = time.monotonic() - start
        log.info(
            "wrote %s: %d samples, %d tokens in %.1f s (%.0f tokens/s; waiting for writes "
            "%.1f s; target loaded once in %.1f s)",
            out,
            len(lengths),
            sum(lengths),
            elapsed,
            sum(lengths) / max(elapsed, 1e-9),
            write_wait_s,
            self.load_s,
        )
        return Path(out)

    def _check_staged(self, staged: StagedBatch, lengths: list[int]) -> None:
        H, n_aux = self.info.hidden_size, len(self.aux_ids)
        for i, rows in zip(staged.batch, staged.rows):
            a, f = rows["aux_hidden"], rows["final_hidden"]
            if a.shape != (lengths[i], n_aux * H) or f.shape != (lengths[i], H):
                raise ExtractError(
                    f"{self.target}: sample {i}: captured aux {a.shape} final "
                    f"{f.shape}, expected ({lengths[i]}, {n_aux * H}) and "
                    f"({lengths[i]}, {H}) (config.json hidden_size={H})"
                )

    def _check(
        self,
        batch: list[int],
        aux: list[torch.Tensor],
        final: list[torch.Tensor],
        lengths: list[int],
    ) -> None:
        """A backend's batch: per sample aux [T_i, n_aux*H] and final [T_i, H]."""
        H, n_aux = self.info.hidden_size, len(self.aux_ids)
        if not len(batch) == len(aux) == len(final):
            raise ExtractError(
                f"backend {self.cfg.backend}: a batch of {len(batch)} samples came "
                f"with {len(aux)} aux and {len(final)} final tensors"
            )
        for i, a, f in zip(batch, aux, final):
            if f.shape[-1] != H or a.shape[-1] != n_aux * H:
                raise ExtractError(
                    f"{self.target}: captured hidden size {f.shape[-1]} (aux "
                    f"{a.shape[-1]}) but config.json says hidden_size={H} "
                    f"({n_aux} aux layers: {n_aux * H})"
                )
            if f.shape[0] != lengths[i] or a.shape[0] != lengths[i]:
                raise ExtractError(
                    f"backend {self.cfg.backend}: sample {i} has {lengths[i]} tokens "
                    f"but {f.shape[0]} final / {a.shape[0]} aux rows"
                )


def _write_staged(writer: ShardWriter, staged: StagedBatch, out: Path) -> None:
    """The writer thread's side of a staged batch: wait for its copy, write, free the buffer."""
    try:
        staged.wait(out)
        for i, rows in zip(staged.batch, staged.rows):
            writer.put_stored(i, rows)
    finally:
        staged.release()


def _write_batch(
    writer: ShardWriter, batch: list[int], aux: list[torch.Tensor], final: list[torch.Tensor]
) -> None:
    """aux[j]: [T_i, n_aux*H]; final[j]: [T_i, H] of sample i = batch[j] (CPU, storage dtype)."""
    for i, a, f in zip(batch, aux, final):
        writer.put(i, a, f)


def extract_shard(
    target: str | Path, shard: str | Path, preflight: str | Path, out: str | Path, settings: dict
) -> Path:
    """Extract `shard` into `out` with a model load of its own (standalone `eyrie extract`).

    The settings and the shard are checked before the load, so a bad shard fails in seconds."""
    parse_settings(settings)
    tokenized = read_tokenized(shard, inspect_target(target).vocab_size)
    with Extractor(target, preflight, settings) as extractor:
        return extractor.extract(shard, out, tokenized=tokenized)
