"""The capture path: a vLLM worker extension that records the residual stream at chosen ids.

Loaded into every worker by `LLM(worker_extension_cls="eyrie.vllm.capture.CaptureExtension")` and
driven by `llm.collective_rpc(...)`: `eyrie_install_capture` replaces the language model's forward
with a loop over its layers driven by the registry's adapter (eyrie.arch.registry) that records
hidden + residual ENTERING layer k for each id k (id N: after the last layer, before the final
norm). Tensor-parallel rank 0 writes `<request_key>.safetensors` ({"hidden_states": [T, n_ids, H],
"token_ids": [T]}) atomically per expected prompt, off the forward's critical path (a copy stream
into pinned memory, a writer thread), into the backend's scratch folder (in memory: /dev/shm).
Needs eager mode, chunked prefill and prefix caching off (the backend sets them). docs/vllm.md.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import traceback
import types
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice

import torch

from eyrie.arch.registry import VllmAdapter, adapter_for
from eyrie.errors import VllmAdapterError
from eyrie.vllm.adapters import EMBED_METHODS, EXTRA_ARGS, call_layer, request_key

log = logging.getLogger("eyrie.vllm.capture")


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
    forward does not wait for the states to reach the host: on a GPU they are copied on a
    stream of their own into a pinned slot (SLOTS of them, reused in turn) and a writer thread
    writes each prompt's file once the copy is done, while the next forwards run."""

    SLOTS = 3

    def __init__(self, layer_ids: list[int], out_dir: str):
        self.layer_ids = layer_ids
        self.out_dir = out_dir
        self.expected: set[str] = set()
        # set by the wrapper's embed when ids go down as embeddings
        self.last_ids: torch.Tensor | None = None
        self.written = 0
        self._count = threading.Lock()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="eyrie-capture")
        self._slots: list[torch.Tensor | None] = [None] * self.SLOTS
        self._pending: list[Future | None] = [None] * self.SLOTS
        self._turn = 0
        self._stream = None

    def record(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, states: torch.Tensor
    ) -> None:
        """input_ids, positions: [num_tokens]; states: [num_tokens, n_ids, H]."""
        if not self.expected:
            return
        if input_ids is None:
            input_ids = self.last_ids
        if input_ids is None:
            raise VllmAdapterError("capture: the forward got neither input_ids nor recorded ids")
        # [num_tokens]; M-RoPE positions are not supported
        pos = positions.reshape(-1).to("cpu").numpy()
        ids = input_ids.to("cpu").numpy()
        starts = [int(i) for i in (pos == 0).nonzero()[0]] + [len(pos)]
        segments = []  # (key, a, b) of the expected prompts, in stream order
        for a, b in zip(starts[:-1], starts[1:]):
            seg = pos[a:b]
            if (seg != range(b - a)).any():
                continue  # not a whole prompt (never the case with chunked prefill off)
            key = request_key(ids[a:b])
            if key in self.expected:
                self.expected.discard(key)
                segments.append((key, a, b))
        if segments:
            self._submit(states, segments, ids)

    def _submit(self, states: torch.Tensor, segments: list, ids) -> None:
        end = segments[-1][2]
        rows = states[:end]  # [rows, n_ids, H]: every expected prompt lies in it
        if rows.device.type != "cuda":
            host, done = rows.to("cpu"), None
        else:
            host, done = self._copy_to_host(rows)
        job = self._pool.submit(self._write_all, host, done, segments, ids)
        self._pending[self._turn] = job
        self._turn = (self._turn + 1) % self.SLOTS

    def _copy_to_host(self, rows: torch.Tensor):
        """rows into this turn's pinned slot on the copy stream (no wait on the host)."""
        pending = self._pending[self._turn]
        if pending is not None:
            pending.result()  # the slot's last writer is done with it
        slot = self._slots[self._turn]
        if slot is None or slot.numel() < rows.numel() or slot.dtype != rows.dtype:
            slot = torch.empty(rows.numel(), dtype=rows.dtype, pin_memory=True)
            self._slots[self._turn] = slot
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        ready = torch.cuda.Event()
        ready.record()
        host = slot[: rows.numel()].view(rows.shape)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            host.copy_(rows, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        rows.record_stream(self._stream)  # its memory is not reused before the copy ends
        return host, done

    def _write_all(self, host: torch.Tensor, done, segments: list, ids) -> None:
        if done is not None:
            done.synchronize()
        for key, a, b in segments:
            self._write(key, host[a:b], ids[a:b])

    def _write(self, key: str, states: torch.Tensor, ids) -> None:
        """states: [T, n_ids, H] on the host; ids: [T] -> `<key>.safetensors`, atomically."""
        from safetensors.torch import save_file

        path = os.path.join(self.out_dir, f"{key}.safetensors")
        tmp = path + f".tmp{os.getpid()}"
        save_file(
            {
                "hidden_states": states.contiguous(),
                "token_ids": torch.from_numpy(ids.astype("int64")),
            },
            tmp,
        )
        os.replace(tmp, path)
        with self._count:
            self.written += 1

    def flush(self) -> None:
        """Wait until every recorded prompt's file is written (raising a writer's error)."""
        for i, job in enumerate(self._pending):
            if job is not None:
                job.result()
                self._pending[i] = None


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
        residual = None
        extras = {name: EXTRA_ARGS[name](config, positions, module) for name in adapter.extras}
        states: dict[int, torch.Tensor] = {}
        for k, layer in enumerate(layers):
            if k in ids:
                # a new tensor: vLLM's fused add-norm updates hidden/residual in place
                states[k] = hidden.clone() if residual is None else hidden + residual
            hidden, residual = call_layer(adapter, layer, positions, hidden, residual, extras)
        if N in ids:
            states[N] = hidden + residual
        hidden, _ = norm(hidden, residual)
        if write and recorder.expected:
            recorder.record(input_ids, positions, torch.stack([states[k] for k in ids], dim=1))
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
            }
        except Exception:
            log.error("eyrie capture install failed:\n%s", traceback.format_exc())
            raise

    def eyrie_expect(self, keys: list[str]) -> int:
        """The request keys whose states the next forwards must write."""
        self._eyrie_recorder.expected = set(keys)
        return len(keys)

    def eyrie_missing(self) -> list[str]:
        """The expected requests not recorded yet, once every recorded one is written."""
        self._eyrie_recorder.flush()
        return sorted(self._eyrie_recorder.expected)
