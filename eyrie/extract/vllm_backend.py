"""Extraction backend "vllm": target hidden states from a vLLM engine (runs in the vLLM
environment), yielded as HostBatches like the Hugging Face backend's on a CPU, in vLLM layer-id
semantics.

The path is chosen the way preflight chose it, from the installed vLLM's facts: "native"
(vLLM's `extract_hidden_states` speculative method and ExampleHiddenStatesConnector: each
request's file is read, checked and removed) or "capture" (eyrie.extract.capture's worker
extension, eager mode). Both need chunked prefill and prefix caching off (a prompt is computed
whole, from position 0). docs/vllm.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from eyrie.arch.registry import adapter_for
from eyrie.core.errors import ExtractError
from eyrie.extract.batches import WRITERS, FileBatch, HostBatch, PinnedStaging, StoredBatch
from eyrie.extract.requestfile import BAD, TOKEN_IDS, RequestFile, request_path
from eyrie.formats.codecs import HIDDEN, bytes_per_token
from eyrie.vllm import fatbin
from eyrie.vllm.adapters import request_key
from eyrie.vllm.checks import ExtractLayers, choose_path, config_problems, version_problems
from eyrie.vllm.engine import bound_kwargs, engine_args
from eyrie.vllm.facts import gather_facts

log = logging.getLogger(__name__)


FILE_WAIT_S = 60.0  # how long a request's file may lag behind generate() returning
SHM = Path("/dev/shm")
# generate() calls whose request files (or their mapped memory) may be held at once: the call
# ahead, the one being read, up to three waiting for or in the writers (batches.Writers), and
# three more in the writers of the shard finishing behind this one (serving.Behind)
SCRATCH_CALLS = 8


def scratch_folder(need_bytes: int) -> Path:
    """Where the engine leaves each request's states for this process to read: in memory
    (/dev/shm) when it has room for SCRATCH_CALLS calls' states, else the temporary folder."""
    try:
        room = SHM.is_dir() and os.access(SHM, os.W_OK) and shutil.disk_usage(SHM).free
    except OSError:
        room = 0
    where = SHM if room and room >= need_bytes else None
    if where is None:
        log.info("scratch: /dev/shm lacks %.1f GiB; request files go to disk", need_bytes / 2**30)
    return Path(tempfile.mkdtemp(prefix="eyrie-vllm-", dir=where))


AUX, FINAL = HIDDEN


def generate_calls(lengths: list[int], tokens_per_call: int) -> list[list[int]]:
    """Samples in order, grouped into generate() calls of at most `tokens_per_call` tokens (a
    longer sample is a call of its own)."""
    calls, call, tokens = [], [], 0
    for i, n in enumerate(lengths):
        if call and tokens + n > tokens_per_call:
            calls.append(call)
            call, tokens = [], 0
        call.append(i)
        tokens += n
    return [*calls, call] if call else calls


def _parts(lengths: list[int], n: int) -> list[list[int]]:
    """Indices 0..len-1 in order, cut into at most n runs of about equal total length."""
    total, parts, run, acc = sum(lengths), [], [], 0
    for j, t in enumerate(lengths):
        run.append(j)
        acc += t
        if acc >= total * (len(parts) + 1) / n and len(parts) < n - 1:
            parts.append(run)
            run = []
    return parts + [run] if run else parts


class _CloseWithLast:
    """Closes a call's request files when the last of its `parts` batches is released (a
    prompt sent twice in one call may lie in two parts, written by two threads)."""

    def __init__(self, files: list[RequestFile], parts: int):
        self.files, self.left, self.lock = files, parts, threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left == 0:
                for f in self.files:
                    f.close()


class VllmBackend:
    name = "vllm"

    def __init__(
        self, target: Path, info, cfg, aux_ids: list[int], final_id: int, engine: dict | None = None
    ):
        """`engine`: preflight.json's vllm.engine.extraction (max_model_len, max_num_batched_tokens,
        max_num_seqs); None (a preflight.json older than it): vLLM's own defaults, with a
        warning."""
        # vLLM forks its engine core unless CUDA is initialised here: the device was resolved
        # through NVML (eyrie.core.runtime.cuda_visible), and nothing touches CUDA before LLM();
        # a spawned engine core would import vLLM again (BENCHMARKS.md, issue 38)
        start = time.perf_counter()
        from vllm import LLM

        log.info("vLLM imported in %.1f s", time.perf_counter() - start)

        self.cfg = cfg
        self.vllm = cfg.vllm
        # seconds states() waited for the engine's next call and spent reading its files
        self.waits = {"engine_s": 0.0, "read_s": 0.0}
        self.layer_ids = list(aux_ids) + [final_id]
        self.n_aux = len(aux_ids)
        self.H = info.hidden_size
        self.tokens_per_call = cfg.max_tokens_per_batch
        config = json.loads((Path(target) / "config.json").read_text())
        adapter = adapter_for(info.model_type)
        facts = gather_facts(config)
        self.path = self._choose_path(target, info, adapter, facts, config)
        # the stored representation is made on a GPU (stored_tensors): by the capture worker on
        # its own, by this process for the native path's files, staged into pinned buffers as
        # the hf backend does; the host only writes (docs/shard-format.md)
        self.staging = PinnedStaging() if cfg.device == "cuda" and self.path == "native" else None
        per_token = max(  # the capture worker's stored rows, or the native path's bf16 states
            bytes_per_token(cfg.storage_dtype, len(self.layer_ids), self.H),
            2 * len(self.layer_ids) * self.H,
        )
        self.scratch = scratch_folder(self.tokens_per_call * per_token * SCRATCH_CALLS)
        kwargs = self._engine_kwargs(target, cfg, engine)
        log.info(
            "vLLM %s, %s path (adapter %s), layer ids %s, tensor parallel %d, weights %s, "
            "lengths %s, scratch %s",
            facts.version,
            self.path,
            adapter.family,
            self.layer_ids,
            kwargs["tensor_parallel_size"],
            "random (rehearsal: load_format dummy)" if "load_format" in kwargs else "loaded",
            engine or "vLLM's defaults",
            self.scratch,
        )
        waited = fatbin.wait_for_compilation()  # compile-kernels compiling this target's kernels
        if waited > 0.5:
            log.info("waited %.1f s for compile-kernels (its kernels load from the cache)", waited)
        self.llm = LLM(**kwargs)
        if self.path == "capture":
            info_ranks = self.llm.collective_rpc(
                "eyrie_install_capture",
                args=(info.model_type, self.layer_ids, str(self.scratch)),
            )
            log.info("capture installed: %s", info_ranks)

    def _choose_path(self, target: Path, info, adapter, facts, config: dict) -> str:
        """native | capture, as preflight chose; raises if this vLLM cannot extract the target."""
        problems = version_problems(facts) + config_problems(adapter, config)
        layers = ExtractLayers(self.layer_ids, info.num_hidden_layers)
        path, path_problems = choose_path(self.vllm.extraction_path, adapter, facts, config, layers)
        if problems or path_problems:
            raise ExtractError(
                f"{target}: vLLM {facts.version} cannot extract this target: "
                + "; ".join(problems + path_problems)
            )
        return path

    def _engine_kwargs(self, target: Path, cfg, engine: dict | None) -> dict:
        """The arguments of vllm.LLM for this path (in a rehearsal, random weights)."""
        if engine is None:
            log.warning(
                "the preflight report has no vllm.engine (made by an older eyrie): vLLM takes its "
                "own max_model_len, the target's context, and profiles a step that long; rerun "
                "preflight (snakemake -R preflight) for lengths from the data (docs/vllm.md)"
            )
        kwargs = engine_args(
            target,
            self.vllm,
            enforce_eager=self.vllm.enforce_eager or self.path == "capture",
            dtype=str(cfg.dtype).removeprefix("torch."),  # extract.dtype, resolved
            trust_remote_code=cfg.trust_remote_code,
            enable_chunked_prefill=False,
            enable_prefix_caching=False,
            **({} if engine is None else bound_kwargs(engine)),
        )
        if self.path == "native":
            kwargs.update(
                speculative_config={
                    "method": "extract_hidden_states",
                    "num_speculative_tokens": 1,
                    "draft_model_config": {
                        "hf_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids}
                    },
                },
                kv_transfer_config={
                    "kv_connector": "ExampleHiddenStatesConnector",
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"shared_storage_path": str(self.scratch)},
                },
            )
        else:
            kwargs["worker_extension_cls"] = "eyrie.extract.capture.CaptureExtension"
        return kwargs

    # ------------------------------------------------------------------ states

    def states(self, input_ids: list[np.ndarray], storage: torch.dtype) -> Iterator[StoredBatch]:
        """The states of every sample, one generate() call's samples per batch. One call runs
        ahead in a thread of its own: the engine computes the next call while this one's
        request files are read (the engine is only ever driven from that thread)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0)
        chunks = generate_calls([len(x) for x in input_ids], self.tokens_per_call)
        with ThreadPoolExecutor(1, thread_name_prefix="eyrie-generate") as ahead:
            self._ahead = (
                ahead.submit(self._generate, input_ids, chunks[0], 0, params) if chunks else None
            )
            for n, chunk in enumerate(chunks):
                t0 = time.monotonic()
                keys, outputs = self._ahead.result()
                self._ahead = (
                    ahead.submit(self._generate, input_ids, chunks[n + 1], n + 1, params)
                    if n + 1 < len(chunks)
                    else None
                )
                t1 = time.monotonic()
                if self.path == "capture":
                    batches = list(self._files(input_ids, chunk, keys, outputs, n))
                else:
                    batches = [self._batch(input_ids, chunk, keys, outputs, storage)]
                self.waits["engine_s"] += t1 - t0
                self.waits["read_s"] += time.monotonic() - t1
                for j, batch in enumerate(batches):
                    try:
                        yield batch
                    except GeneratorExit:  # the extraction stopped: free the call's other parts
                        for rest in batches[j + 1 :]:
                            rest.release()
                        raise

    def _generate(self, input_ids: list[np.ndarray], chunk: list[int], call: int, params):
        """generate() call number `call` (max_tokens 1) for `chunk`: (request keys, outputs)."""
        prompts = [{"prompt_token_ids": input_ids[i].astype(np.int64).tolist()} for i in chunk]
        keys = [request_key(input_ids[i]) for i in chunk]
        if self.path == "capture":  # the previous call's prompts are all recorded by now
            expect = (sorted(set(keys)), call, self.cfg.storage_dtype)
            self.llm.collective_rpc("eyrie_expect", args=expect)
        return keys, self.llm.generate(prompts, params, use_tqdm=False)

    def _files(self, input_ids, chunk, keys, outputs, call: int) -> Iterator[FileBatch]:
        """One capture call's request files, as up to WRITERS batches of about equal tokens (one
        per writer thread): the worker made the stored representation and its finite flags, so
        the writers have the kernel copy the rows into the shard as they are. Each file is
        removed once open; its memory goes when the call's batches are released."""
        files: dict[str, RequestFile] = {}
        bad: dict[str, np.ndarray] = {}
        try:
            for i, key, out in zip(chunk, keys, outputs):
                if key in files:
                    continue  # the same prompt twice in one call: recorded once
                path = self._wait_for(request_path(self.scratch, call, key), out)
                files[key] = f = RequestFile(path)
                path.unlink()
                got = f.read(TOKEN_IDS) if TOKEN_IDS in f.arrays else None
                if got is None or BAD not in f.arrays or not np.array_equal(got, input_ids[i]):
                    raise ExtractError(
                        f"{path}: the capture worker wrote states for other token ids than the "
                        f"{len(input_ids[i])}-token prompt it was sent (or no {TOKEN_IDS!r}/"
                        f"{BAD!r}); this vLLM's capture is broken for this target: report it "
                        "with the log"
                    )
                bad[key] = f.read(BAD)
        except BaseException:
            for f in files.values():
                f.close()
            raise
        lengths = [len(input_ids[i]) for i in chunk]
        parts = _parts(lengths, WRITERS)
        free = _CloseWithLast(list(files.values()), len(parts))
        for part in parts:
            part_keys = [keys[j] for j in part]
            yield FileBatch(
                [chunk[j] for j in part],
                [lengths[j] for j in part],
                [
                    {n: files[k].source(n) for n in files[k].arrays if n not in (BAD, TOKEN_IDS)}
                    for k in part_keys
                ],
                [(files[k].arrays[AUX][1], files[k].arrays[FINAL][1]) for k in part_keys],
                np.concatenate([bad[k] for k in part_keys]),
                free=free,
            )

    def _batch(self, input_ids, chunk, keys, outputs, storage: torch.dtype) -> StoredBatch:
        """One native call's states read from vLLM's request files (removed after), as a batch
        for the writers."""
        # [T, n_ids, H] per request, read from its file
        got = [self._states_of(out, key, input_ids[i]) for i, key, out in zip(chunk, keys, outputs)]
        if self.staging is not None:
            return self._staged(chunk, got)
        aux_list, final_list = [], []
        for hs in got:
            hs = hs.to(storage)
            aux_list.append(hs[:, : self.n_aux].reshape(len(hs), self.n_aux * self.H))
            final_list.append(hs[:, self.n_aux])
        return HostBatch(chunk, aux_list, final_list)

    def _staged(self, chunk: list[int], got: list[torch.Tensor]) -> StoredBatch:
        """The chunk's states copied to this process's GPU, put in their stored representation
        there (conversion and finite checks) and staged for the writers without blocking."""
        from eyrie.formats.codecs import stored_tensors

        lens = [len(hs) for hs in got]
        rows = torch.empty(
            (sum(lens), len(self.layer_ids), self.H), dtype=got[0].dtype, device="cuda"
        )
        at = 0
        for hs in got:  # one copy each: no concatenation on the host
            rows[at : at + len(hs)].copy_(hs)
            at += len(hs)
        aux = rows[:, : self.n_aux].reshape(len(rows), self.n_aux * self.H)
        stored, bad = stored_tensors(aux, rows[:, self.n_aux], self.cfg.storage_dtype)
        del rows, aux
        return self.staging.stage(chunk, lens, stored, bad)

    def _states_of(self, out, key: str, ids: np.ndarray) -> torch.Tensor:
        """One native request's hidden states [T, n_ids, H], checked against its prompt `ids`
        [T]; its file (and the connector's lock file) removed once read."""
        hs, got = self._read(self._file_of(out))
        T = len(ids)
        if hs.shape != (T, len(self.layer_ids), self.H) or not np.array_equal(
            got, ids.astype(np.int64)
        ):
            raise ExtractError(
                f"vLLM returned hidden states {tuple(hs.shape)} for a "
                f"{T}-token prompt (expected {(T, len(self.layer_ids), self.H)}) "
                "or other token ids; this vLLM's extraction is broken for "
                "this target: try vllm.extraction_path: capture"
            )
        return hs

    def _file_of(self, out) -> Path:
        """The native connector's file of request `out`."""
        params = out.kv_transfer_params or {}
        if "hidden_states_path" not in params:
            raise ExtractError(
                f"vLLM request {out.request_id}: no hidden_states_path in "
                f"kv_transfer_params ({sorted(params)}); the connector did not run"
            )
        return Path(params["hidden_states_path"])

    def _wait_for(self, path: Path, out) -> Path:
        """The capture worker's request file `path`, once written (it may lag behind generate()
        returning by up to FILE_WAIT_S)."""
        deadline = time.monotonic() + FILE_WAIT_S
        while not path.exists():
            if time.monotonic() > deadline:
                if getattr(self, "_ahead", None) is not None:
                    self._ahead.result()  # one thread drives the engine at a time
                missing = self.llm.collective_rpc("eyrie_missing")[0]
                raise ExtractError(
                    f"capture: no states written for request {out.request_id} "
                    f"({len(missing)} expected requests still missing); the capture "
                    "forward was bypassed (is enforce_eager on?)"
                )
            time.sleep(0.002)
        return path

    def _read(self, path: Path) -> tuple[torch.Tensor, np.ndarray]:
        """A native request file: (hidden_states [T, n_ids, H], token_ids int64 [T]), then
        removed with its lock file (the connector leaves both)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E501
            load_hidden_states,
        )

        data = load_hidden_states(str(path))  # waits on the writer's lock
        for done in (path, Path(f"{path}.lock")):
            done.unlink(missing_ok=True)
        try:
            return data["hidden_states"], data["token_ids"].numpy().astype(np.int64)
        except KeyError as exc:
            raise ExtractError(f"{path}: key {exc} missing in vLLM's hidden-states file") from None

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            del llm
        shutil.rmtree(getattr(self, "scratch", ""), ignore_errors=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
