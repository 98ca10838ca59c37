"""Extraction of target hidden states into HDF5 shards: `Extractor` (one target load, many
shards), writing what its backend yields through the one write path (eyrie.extract.batches).

`Extractor(target, preflight, settings)` checks the settings, the target and its preflight
report, then opens the backend named by `extract.backend` (`BACKENDS`: the one model load);
`extract(shard, out)` writes one shard per call. Every backend yields `StoredBatch`es, which
writer threads turn into stored rows and write at their file offsets while the next batch runs.
docs/extraction.md (the engine and its clients), docs/shard-format.md ("Extraction").
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Protocol

import numpy as np

from eyrie.arch.target import inspect_target, resolve_layer_ids, tokenizer_hash
from eyrie.config.schema import merge_settings
from eyrie.config.sections import ExtractSettings
from eyrie.core.errors import ExtractError
from eyrie.core.io import provenance
from eyrie.core.rehearsal import is_rehearsal
from eyrie.extract.batches import StoredBatch, Writers
from eyrie.formats.tokenized import Tokenized, read_tokenized

if TYPE_CHECKING:
    import torch

    from eyrie.formats.hidden import ShardMeta

log = logging.getLogger(__name__)


# backend name -> "module:Class", imported only when chosen (vLLM is not installed everywhere)
BACKENDS = {"hf": "eyrie.extract.hf:HFBackend", "vllm": "eyrie.extract.vllm_backend:VllmBackend"}

PROGRESS_EVERY_S = 5.0


class Backend(Protocol):
    """What a backend provides. The constructor is the (one) model load: `Backend(target: Path,
    info: TargetInfo, cfg: ExtractSettings, aux_ids: list[int], final_id: int)`."""

    def states(self, input_ids: list[np.ndarray], storage: torch.dtype) -> Iterator[StoredBatch]:
        """Hidden states of every sample of `input_ids` (token ids int32 [T_i] each), batch after
        batch, each sample exactly once; host tensors travel in the `storage` dtype
        (transfer_dtype)."""

    def close(self) -> None:
        """Release the model (GPU memory, worker processes)."""


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


class Extractor:
    """One target load, many shards.

    The constructor checks the settings, the target and its preflight report, then opens the
    backend (the one model load); `extract(shard, out)` writes one HDF5 shard per call.
    """

    def __init__(
        self, target: str | Path, preflight: str | Path, settings: dict, runtime: dict | None = None
    ):
        # the producer records the settings with the runtime (the engine's GPU memory share)
        self.target, self.settings = Path(target), merge_settings(settings, runtime or {})
        self.cfg = ExtractSettings.from_settings(settings, runtime)
        self.info = inspect_target(target)
        from eyrie.formats.report import read_report

        report = read_report(preflight, self.info.fingerprint)
        self.aux_ids, self.final_id = resolve_layer_ids(
            self.cfg.aux_ids, self.info.num_hidden_layers
        )
        self.tokenizer_hash = tokenizer_hash(target)
        cls = backend_class(self.cfg.backend)
        t0 = time.monotonic()
        # the vLLM engine's lengths, as preflight chose them and sized its memory for
        engine = ((report.get("vllm") or {}).get("engine") or {}).get("extraction")
        extra = {"engine": engine} if self.cfg.backend == "vllm" else {}
        self.backend: Backend = cls(
            self.target, self.info, self.cfg, self.aux_ids, self.final_id, **extra
        )
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
        return self.start(shard, out, tokenized).finish()

    def start(
        self, shard: str | Path, out: str | Path, tokenized: Tokenized | None = None
    ) -> PendingShard:
        """The model's part of `extract`: every sample through the backend, every batch handed
        to the writers. Returns once the backend has yielded its last batch; the last writes,
        the fsync and the rename are `PendingShard.finish`'s, which the engine runs while the
        next shard computes. A failure here leaves no shard (its temporary file is removed)."""
        import torch

        from eyrie.formats.codecs import transfer_dtype
        from eyrie.formats.hidden_writer import ShardWriter

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
        with contextlib.ExitStack() as stack:
            writer = stack.enter_context(
                ShardWriter(out, self._meta(), sample_ids, input_ids, loss_masks)
            )
            writers = stack.enter_context(Writers(writer))
            with torch.inference_mode():
                for item in self.backend.states(input_ids, storage):
                    try:
                        self._check(item, lengths)
                    except BaseException:
                        item.release()  # the backend's buffers outlive this shard
                        raise
                    writers.submit(item)
                    progress.add(item.batch)
            # kept open for finish(): a failure above closed them (the temporary file removed)
            return PendingShard(Path(out), stack.pop_all(), writers, progress, self.load_s)

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


class PendingShard:
    """A shard whose batches are all with the writers (`Extractor.start`): `finish()` waits for
    the writes, then closes the shard (validation, fsync, rename: complete only then) and
    returns its path; `abandon()` removes it instead. Either may run in another thread than
    the start; one of them must run. `compute_s`, `close_s`: where its time went (the
    backend's loop; the close), beside `writers.wait_s` (waiting for the writers)."""

    def __init__(self, out: Path, held, writers: Writers, progress: _Progress, load_s: float):
        self.out, self.held, self.writers, self.progress = out, held, writers, progress
        self.load_s = load_s
        self.compute_s = time.monotonic() - progress.start
        self.close_s = 0.0

    def finish(self) -> Path:
        try:
            self.writers.join()
        except BaseException:
            self.held.__exit__(*sys.exc_info())  # the shard's temporary file goes
            raise
        t0 = time.monotonic()
        self.held.close()  # Writers, then ShardWriter: validation, fsync, rename
        self.close_s = time.monotonic() - t0
        self.progress.wrote(self.out, self.writers.wait_s, self.load_s)
        return self.out

    def abandon(self) -> None:
        """No shard: the writes under way end, the temporary file is removed."""
        why = ExtractError(f"{self.out}: abandoned before its close")
        self.held.__exit__(ExtractError, why, None)


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
    ExtractSettings.from_settings(settings)
    tokenized = read_tokenized(shard, inspect_target(target).vocab_size)
    with Extractor(target, preflight, settings) as extractor:
        return extractor.extract(shard, out, tokenized=tokenized)
