"""The capture path: a vLLM worker extension that records the residual stream at chosen ids.

Loaded into every worker by `LLM(worker_extension_cls="eyrie.extract.capture.CaptureExtension")` and
driven by `llm.collective_rpc(...)`: `eyrie_install_capture` replaces the language model's forward
with a loop over its layers driven by the registry's adapter (eyrie.arch.registry) that records
hidden + residual ENTERING layer k for each id k (id N: after the last layer, before the final
norm). Tensor-parallel rank 0 puts them in the shard's stored representation on its GPU and
writes one request file per expected prompt (eyrie.extract.requestfile), off the forward's critical
path (a copy stream into pinned memory, writer threads), into the backend's scratch folder (in
memory: /dev/shm). Needs eager mode, chunked prefill and prefix caching off (the backend sets
them). docs/vllm.md.
"""

from __future__ import annotations

import importlib
import logging
import threading
import traceback
import types
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice

import torch

from eyrie.arch.registry import VllmAdapter, adapter_for
from eyrie.core.errors import VllmAdapterError
from eyrie.extract.requestfile import BAD, TOKEN_IDS, request_path, write_request
from eyrie.formats.codecs import stored_tensors
from eyrie.vllm.adapters import EMBED_METHODS, EXTRA_ARGS, call_layer, request_key

log = logging.getLogger("eyrie.extract.capture")


def _language_model(model):
    """The decoder stack (e.g. LlamaModel) under a CausalLM or a multimodal wrapper."""
    lm = model.get_language_model() if hasattr(model, "get_language_model") else model
    inner = getattr(lm, "model", None)
    if inner is None:
        raise VllmAdapterError(f"{type(lm).__name__} has no .model decoder stack")
    return lm, inner


class _Recorder:
    """Splits each forward's token stream into prompts and writes the expected ones.

    vLLM batches many prompts into one flat stream per forward; with chunked prefill and prefix
    caching off each prompt is one run of positions 0..T-1, matched by its `request_key`. The
    states are put in their stored representation on the worker's own device (stored_tensors:
    what the shard holds, half the bytes for float8), and the forward does not wait for them to
    reach the host: on a GPU they are copied on a stream of their own into a pinned slot (SLOTS
    of them, reused in turn) and writer threads write each prompt's request file
    (eyrie.extract.requestfile) once the copy is done, while the next forwards run."""

    SLOTS = 3
    WRITERS = 4
    ALIGN = 256

    def __init__(self, layer_ids: list[int], out_dir: str, storage_dtype: str = "bfloat16"):
        self.layer_ids = layer_ids
        self.out_dir = out_dir
        # of the shard the expected requests go to, and the generate() call they belong to
        self.storage_dtype = storage_dtype
        self.expected: set[str] = set()
        self.call = 0
        # set by the wrapper's embed when ids go down as embeddings
        self.last_ids: torch.Tensor | None = None
        self.written = 0
        self._count = threading.Lock()
        self._pool = ThreadPoolExecutor(self.WRITERS, thread_name_prefix="eyrie-capture")
        self._slots: list[torch.Tensor | None] = [None] * self.SLOTS
        self._pending: list[list[Future]] = [[] for _ in range(self.SLOTS)]
        self._turn = 0
        self._stream = None

    def segments(self, input_ids: torch.Tensor | None, positions: torch.Tensor) -> list:
        """(key, a, b, ids) of the expected prompts in this forward's stream, in stream order
        (read before the layers run: the inputs are ready, the forward's work is not queued
        behind a wait on the host)."""
        if not self.expected:
            return []
        if input_ids is None:
            input_ids = self.last_ids
        if input_ids is None:
            raise VllmAdapterError("capture: the forward got neither input_ids nor recorded ids")
        # [num_tokens]; M-RoPE positions are not supported
        pos = positions.reshape(-1).to("cpu").numpy()
        ids = input_ids.to("cpu").numpy()
        starts = [int(i) for i in (pos == 0).nonzero()[0]] + [len(pos)]
        found = []
        for a, b in zip(starts[:-1], starts[1:]):
            seg = pos[a:b]
            if (seg != range(b - a)).any():
                continue  # not a whole prompt (never the case with chunked prefill off)
            key = request_key(ids[a:b])
            if key in self.expected:
                self.expected.discard(key)
                found.append((key, a, b, ids[a:b].astype("int64")))
        return found

    def record(self, states: list[torch.Tensor], segments: list) -> None:
        """states: [num_tokens, H] per layer id, in layer_ids order (the last is the final id)."""
        end = segments[-1][2]  # every expected prompt lies in the first `end` rows
        rows = [x[:end] for x in states]
        aux = torch.stack(rows[:-1], dim=1).reshape(end, -1)
        stored, bad = stored_tensors(aux, rows[-1], self.storage_dtype)
        parts = {**stored, BAD: bad}
        del aux, rows
        if bad.device.type != "cuda":
            host, done = {k: v.numpy() for k, v in parts.items()}, None
        else:
            host, done = self._copy_to_host(parts)
        self._pending[self._turn] = [
            self._pool.submit(self._write, host, done, seg, self.call) for seg in segments
        ]
        self._turn = (self._turn + 1) % self.SLOTS

    def _copy_to_host(self, parts: dict[str, torch.Tensor]):
        """parts into this turn's pinned slot on the copy stream (no wait on the host):
        ({name: numpy view of the slot}, the copy's event)."""
        for job in self._pending[self._turn]:
            job.result()  # the slot's last writers are done with it
        sizes = [
            -(-x.numel() * x.element_size() // self.ALIGN) * self.ALIGN for x in parts.values()
        ]
        slot = self._slots[self._turn]
        if slot is None or slot.numel() < sum(sizes):
            slot = torch.empty(int(sum(sizes) * 1.25), dtype=torch.uint8, pin_memory=True)
            self._slots[self._turn] = slot
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        ready = torch.cuda.Event()
        ready.record()
        host, at = {}, 0
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            for (name, x), size in zip(parts.items(), sizes):
                view = slot[at : at + x.numel() * x.element_size()].view(x.dtype).view(x.shape)
                view.copy_(x, non_blocking=True)
                x.record_stream(self._stream)  # its memory is not reused before the copy ends
                host[name] = view.numpy()
                at += size
            done = torch.cuda.Event()
            done.record(self._stream)
        return host, done

    def _write(self, host: dict, done, segment: tuple, call: int) -> None:
        """One prompt's rows of `host` -> its request file, atomically."""
        if done is not None:
            done.synchronize()
        key, a, b, ids = segment
        arrays = {name: x[a:b] for name, x in host.items()}
        arrays[TOKEN_IDS] = ids
        write_request(request_path(self.out_dir, call, key), arrays)
        with self._count:
            self.written += 1

    def flush(self) -> None:
        """Wait until every recorded prompt's file is written (raising a writer's error)."""
        for jobs in self._pending:
            for job in jobs:
                job.result()
            jobs.clear()


def make_forward(adapter, inner, module, recorder: _Recorder, write: bool):
    """The replacement for `inner.forward` (same signature as vLLM's decoder-stack forward)."""
    embed = getattr(inner, next(m for m in EMBED_METHODS if hasattr(inner, m)))
    layers = (
        list(islice(getattr(inner, adapter.layers_attr), inner.start_layer, inner.end_layer))
        if hasattr(inner, "start_layer")
        else list(getattr(inner, adapter.layers_attr))
    )
    norm = getattr(inner, adapter.norm_attr)
    config = inner.config
    ids = recorder.layer_ids
    N = len(layers)

    def forward(
        self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs
    ):
        hidden = inputs_embeds if inputs_embeds is not None else embed(input_ids)
        segments = recorder.segments(input_ids, positions) if write else []
        residual = None
        extras = {name: EXTRA_ARGS[name](config, positions, module) for name in adapter.extras}
        states: dict[int, torch.Tensor] = {}
        for k, layer in enumerate(layers):
            if segments and k in ids:
                # a new tensor: vLLM's fused add-norm updates hidden/residual in place
                states[k] = hidden.clone() if residual is None else hidden + residual
            hidden, residual = call_layer(adapter, layer, positions, hidden, residual, extras)
        if segments and N in ids:
            states[N] = hidden + residual
        hidden, _ = norm(hidden, residual)
        if segments:
            recorder.record([states[k] for k in ids], segments)
        return hidden

    return forward


def _check_decoder_stack(inner, adapter: VllmAdapter) -> None:
    """The decoder stack is the adapter's class (or a subclass) and has an embedding method."""
    if type(inner).__name__ != adapter.model_class and not any(
        c.__name__ == adapter.model_class for c in type(inner).__mro__
    ):
        raise VllmAdapterError(
            f"capture: the language model is {type(inner).__name__}, but "
            f"the {adapter.family} adapter expects {adapter.model_class}"
        )
    if not any(hasattr(inner, m) for m in EMBED_METHODS):
        raise VllmAdapterError(f"capture: {type(inner).__name__} has none of {list(EMBED_METHODS)}")


def _keep_input_ids(model, recorder: _Recorder) -> None:
    """Multimodal wrappers embed first and pass only embeddings down: keep the ids they got."""
    original = model.embed_input_ids

    def embed_and_keep(input_ids, *args, **kwargs):
        recorder.last_ids = input_ids
        return original(input_ids, *args, **kwargs)

    model.embed_input_ids = embed_and_keep


class CaptureExtension:
    """Methods mixed into vLLM's GPU worker (called through LLM.collective_rpc)."""

    def eyrie_install_capture(self, model_type: str, layer_ids: list[int], out_dir: str) -> dict:
        try:
            adapter = adapter_for(model_type)
            model = (
                self.model_runner.get_model()
                if hasattr(self.model_runner, "get_model")
                else self.model_runner.model
            )
            lm, inner = _language_model(model)
            _check_decoder_stack(inner, adapter)
            module = importlib.import_module(f"vllm.model_executor.models.{adapter.module}")
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            recorder = _Recorder(list(layer_ids), out_dir)
            inner.forward = types.MethodType(
                make_forward(adapter, inner, module, recorder, rank == 0), inner
            )
            if lm is not model and hasattr(model, "embed_input_ids"):
                _keep_input_ids(model, recorder)
            self._eyrie_recorder = recorder
            return {
                "rank": rank,
                "model_class": type(inner).__name__,
                "adapter": adapter.family,
                "layers": len(getattr(inner, adapter.layers_attr)),
                "runner": type(self.model_runner).__module__,  # V1's or V2's (vLLM's choice)
            }
        except Exception:
            log.error("eyrie capture install failed:\n%s", traceback.format_exc())
            raise

    def eyrie_expect(self, keys: list[str], call: int, storage_dtype: str) -> int:
        """The request keys whose states the next forwards (generate() call `call`) must write,
        in the stored representation of `storage_dtype` (the shard's, which may change between
        shards of one engine)."""
        self._eyrie_recorder.call = call
        self._eyrie_recorder.storage_dtype = storage_dtype
        self._eyrie_recorder.expected = set(keys)
        return len(keys)

    def eyrie_missing(self) -> list[str]:
        """The expected requests not recorded yet, once every recorded one is written."""
        self._eyrie_recorder.flush()
        return sorted(self._eyrie_recorder.expected)
