"""The capture path's forward and recorder (eyrie.extract.capture) on a decoder stack shaped like
vLLM's: layers take (positions, hidden_states, residual) and update the residual IN PLACE through a
fused add-norm, the way vLLM's RMSNorm(x, residual) does. The real-vLLM run is on a GPU
(tests/support/vllm_gpu_check.py); this checks the id semantics, the in-place safety and the
splitting of a batched token stream into prompts, on CPU."""

from __future__ import annotations

import sys
import threading
import time
import types

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from eyrie.arch.registry import REGISTRY
from eyrie.core.errors import VllmAdapterError
from eyrie.extract.capture import _Recorder, make_forward
from eyrie.extract.requestfile import read_request, request_path, write_request
from eyrie.formats.codecs import stored_tensors
from eyrie.formats.hidden import ShardMeta, ShardReader
from eyrie.formats.hidden_writer import ShardWriter
from eyrie.vllm.adapters import call_layer, request_key

H = 8


class AddNorm(torch.nn.Module):
    """vLLM-style RMSNorm: with a residual, residual += x IN PLACE and returns
    (norm(residual), residual)."""

    def forward(self, x, residual=None):
        if residual is None:
            return x / x.norm(dim=-1, keepdim=True)
        residual.add_(x)
        return residual / residual.norm(dim=-1, keepdim=True), residual


class Layer(torch.nn.Module):
    def __init__(self, seed: int, positional_extra: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(H, H, generator=g) / H**0.5)
        self.norm = AddNorm()

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states  # aliases the embeddings, as vLLM's LlamaDecoderLayer does
            hidden_states = self.norm(hidden_states)
        else:
            hidden_states, residual = self.norm(hidden_states, residual)
        out = torch.tanh(hidden_states @ self.w) + positions[:, None] * 0.01
        out, residual = self.norm(out, residual)  # in place on residual
        return out @ self.w.T, residual


class Stack(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(i) for i in range(n))
        self.norm = AddNorm()
        self.embed = torch.nn.Embedding(50, H)
        self.config = types.SimpleNamespace()

    def embed_input_ids(self, ids):
        return self.embed(ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hidden, residual = self.embed_input_ids(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]


def reference_states(
    stack: Stack, ids: torch.Tensor, positions: torch.Tensor
) -> dict[int, torch.Tensor]:
    """Residual stream entering each layer, computed on fresh copies (no aliasing possible)."""
    out = {}
    hidden, residual = stack.embed_input_ids(ids).clone(), None
    for k, layer in enumerate(stack.layers):
        out[k] = (hidden if residual is None else hidden + residual).clone()
        hidden, residual = layer(
            positions, hidden.clone(), None if residual is None else residual.clone()
        )
    out[len(stack.layers)] = hidden + residual
    return out


LLAMA = REGISTRY["llama"].vllm


def install(stack, ids, tmp_path, storage_dtype="float32"):
    rec = _Recorder(ids, str(tmp_path), storage_dtype)
    original = Stack.forward
    stack.forward = types.MethodType(make_forward(LLAMA, stack, None, rec, write=True), stack)
    return rec, original


def test_forward_output_unchanged_and_states_match_reference(tmp_path):
    torch.manual_seed(0)
    stack = Stack(4)
    prompts = [[3, 9, 4, 1, 7], [5, 2], [8, 8, 8, 1, 2, 3, 4]]
    flat = torch.tensor(sum(prompts, []))
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        expected_out = Stack.forward(stack, flat, positions)
        ids = [0, 1, 2, 4]
        rec, _ = install(stack, ids, tmp_path)
        rec.expected = {request_key(p) for p in prompts}
        out = stack(flat, positions)
    rec.flush()
    assert torch.equal(out, expected_out)  # the replaced forward computes what vLLM's does
    assert rec.expected == set() and rec.written == 3
    for p in prompts:
        # a safetensors file any reader opens: the shard's datasets, flags and the prompt
        saved = load_file(str(request_path(tmp_path, 0, request_key(p))))
        assert sorted(saved) == ["aux_hidden", "bad", "final_hidden", "token_ids"]
        assert saved["token_ids"].tolist() == p and not saved["bad"].any()
        ref = reference_states(stack, torch.tensor(p), torch.arange(len(p)))
        # aux [T, 3*H] = ids 0, 1, 2 side by side (0 = embeddings); final [T, H] = id 4 = N,
        # after the last layer, before the norm
        aux = torch.from_numpy(saved["aux_hidden"]).view(len(p), 3, H)
        for j, k in enumerate(ids[:-1]):
            torch.testing.assert_close(aux[:, j], ref[k], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            torch.from_numpy(saved["final_hidden"]), ref[4], rtol=1e-6, atol=1e-6
        )


def test_only_expected_prompts_are_written_and_padding_is_ignored(tmp_path):
    stack = Stack(2)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    # a trailing run of padding tokens at position 0, as a padded batch would carry
    flat = torch.tensor(sum(prompts, []) + [0, 0])
    positions = torch.tensor([0, 1, 2, 0, 1, 2, 3, 0, 0])
    rec, _ = install(stack, [1, 2], tmp_path)
    rec.expected = {request_key(prompts[1])}
    with torch.no_grad():
        stack(flat, positions)
    rec.flush()
    assert list(tmp_path.iterdir()) == [request_path(tmp_path, 0, request_key(prompts[1]))]
    assert rec.expected == set()


def test_request_files_hold_the_stored_representation_the_shard_gets(tmp_path):
    """float8 storage: the worker's codes and scales are stored_tensors' of the same states, and
    a shard written from the mapped files reads back as a shard written from the states."""
    stack = Stack(3)
    prompts = [[3, 9, 4, 1, 7], [5, 2, 6]]
    flat = torch.tensor(sum(prompts, []))
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    rec, _ = install(stack, [1, 2, 3], tmp_path / "scratch", "float8_e4m3")
    (tmp_path / "scratch").mkdir()
    rec.expected = {request_key(p) for p in prompts}
    with torch.no_grad():
        stack(flat, positions)
    rec.flush()
    meta = ShardMeta("fp", "tok", [1, 2], 3, H, "float8_e4m3")
    masks = [[1] * len(p) for p in prompts]
    # the states of the same batched forward the worker captured (a prompt's forward alone may
    # round differently in the last bit: the BLAS kernel depends on the number of rows)
    full = reference_states(stack, flat, positions)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0).tolist()
    refs = [{k: v[end - len(p) : end] for k, v in full.items()} for p, end in zip(prompts, ends)]
    with (
        ShardWriter(tmp_path / "mapped.h5", meta, ["a", "b"], prompts, masks) as mapped,
        ShardWriter(tmp_path / "direct.h5", meta, ["a", "b"], prompts, masks) as direct,
    ):
        for i, (p, ref) in enumerate(zip(prompts, refs)):
            got = read_request(request_path(tmp_path / "scratch", 0, request_key(p)))
            want, _ = stored_tensors(torch.cat([ref[1], ref[2]], dim=1), ref[3], "float8_e4m3")
            assert sorted(want) == sorted(set(got) - {"bad", "token_ids"})
            for name, x in want.items():
                assert np.array_equal(got[name], x.numpy()), name
            mapped.put_stored(i, {k: v for k, v in got.items() if k in want})
            direct.put(i, torch.cat([ref[1], ref[2]], dim=1), ref[3])
    with ShardReader(tmp_path / "mapped.h5") as a, ShardReader(tmp_path / "direct.h5") as b:
        for i in range(2):
            x, y = a.read(i), b.read(i)
            assert all(torch.equal(x[k], y[k]) for k in y)


def test_nothing_is_recorded_without_expected_requests(tmp_path):
    stack = Stack(2)
    rec, _ = install(stack, [1, 2], tmp_path)
    with torch.no_grad():
        stack(torch.tensor([1, 2, 3]), torch.arange(3))  # e.g. vLLM's warm-up forward
    rec.flush()
    assert list(tmp_path.iterdir()) == []


def test_positional_adapter_passes_extras_in_order():
    calls = []

    class DeepseekStyle(torch.nn.Module):
        def forward(self, positions, hidden_states, residual, llama_4_scaling=None):
            calls.append(llama_4_scaling)
            return hidden_states, hidden_states if residual is None else residual

    adapter = REGISTRY["deepseek_v3"].vllm
    h = torch.ones(2, H)
    call_layer(adapter, DeepseekStyle(), torch.arange(2), h, None, {"llama_4_scaling": "SCALE"})
    assert calls == ["SCALE"]


def test_layer_returning_one_tensor_is_a_clear_error():
    class Single(torch.nn.Module):
        def forward(self, positions, hidden_states, residual):
            return hidden_states

    with pytest.raises(
        VllmAdapterError, match=r"returned Tensor, expected \(hidden_states, residual\)"
    ):
        call_layer(REGISTRY["llama"].vllm, Single(), torch.arange(2), torch.ones(2, H), None, {})


def test_keyword_adapter_follows_parameter_names_not_order():
    class GptOssStyle(torch.nn.Module):  # hidden_states first, positions second
        def forward(self, hidden_states, positions, residual):
            assert positions.dtype == torch.long and hidden_states.dtype == torch.float32
            return hidden_states, hidden_states

    call_layer(REGISTRY["gpt_oss"].vllm, GptOssStyle(), torch.arange(2), torch.ones(2, H), None, {})


def test_request_key_depends_on_every_token():
    assert request_key([1, 2, 3]) == request_key(np.array([1, 2, 3], dtype=np.int32))
    assert request_key([1, 2, 3]) != request_key([1, 2, 4])
    assert request_key([1, 2]) != request_key([1, 2, 0])


class _FakeEngine:
    """A stand-in for vllm.LLM on the capture path: generate() writes each prompt's request file
    (bfloat16 states that are a function of the token ids, in their stored representation) as
    the capture worker does, slowly enough that the next call overlaps the reading of the last
    one; it records its calls' threads."""

    def __init__(self, scratch, n_aux: int, H: int):
        self.scratch, self.n_aux, self.H = scratch, n_aux, H
        self.threads: set[str] = set()
        self.call = None

    def collective_rpc(self, name, args=()):
        self.threads.add(threading.current_thread().name)
        if name == "eyrie_expect":
            self.call, self.storage = args[1], args[2]
        return [[]]

    def generate(self, prompts, params, use_tqdm=False):
        self.threads.add(threading.current_thread().name)
        time.sleep(0.05)
        outs = []
        for n, p in enumerate(prompts):
            ids = torch.tensor(p["prompt_token_ids"], dtype=torch.int64)
            aux = (ids[:, None].float() + torch.arange(self.n_aux) / 10).repeat_interleave(
                self.H, dim=1
            )
            final = (ids[:, None].float() + self.n_aux / 10).expand(-1, self.H)
            stored, bad = stored_tensors(aux, final, self.storage)
            arrays = {k: v.numpy() for k, v in stored.items()}
            arrays.update(bad=bad.numpy(), token_ids=ids.numpy())
            write_request(request_path(self.scratch, self.call, request_key(ids.numpy())), arrays)
            outs.append(types.SimpleNamespace(request_id=str(n)))
        return outs


def _capture_backend(scratch, layer_ids, H, storage_dtype="bfloat16"):
    """A VllmBackend on the capture path around a stand-in engine (no vLLM)."""
    from eyrie.extract import vllm_backend as vb

    b = object.__new__(vb.VllmBackend)
    b.path, b.layer_ids, b.n_aux, b.H = "capture", layer_ids, len(layer_ids) - 1, H
    b.tokens_per_call, b.scratch, b.staging = 8, scratch, None
    b.waits = {"engine_s": 0.0, "read_s": 0.0}
    b.cfg = types.SimpleNamespace(storage_dtype=storage_dtype)
    b.llm = _FakeEngine(scratch, len(layer_ids) - 1, H)
    return b


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3"])
def test_vllm_backend_reads_each_call_while_the_next_runs(tmp_path, monkeypatch, storage):
    """VllmBackend.states on the capture path with a stand-in engine, written by the real
    writer threads into a real shard: every sample's states where they belong, the engine
    driven from one thread only, a prompt that recurs in the next call and one sent twice in
    a call read each time, and every request file removed."""
    from eyrie.extract.batches import Writers

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: kw))
    (tmp_path / "scratch").mkdir()
    b = _capture_backend(tmp_path / "scratch", [1, 2, 3, 4], 8, storage)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8], [12, 13, 14], [12, 13, 14], [17, 18]]
    ids = [np.array(p, dtype=np.int32) for p in prompts]
    meta = ShardMeta("fp", "tok", [1, 2, 3], 4, 8, storage)
    names = [str(i) for i in range(len(prompts))]
    with ShardWriter(tmp_path / "s.h5", meta, names, prompts, [[1] * len(p) for p in prompts]) as w:
        with Writers(w) as writers:
            batches = []
            for x in b.states(ids, torch.bfloat16):
                assert not x.bad.any() and len(x.bad) == sum(len(prompts[i]) for i in x.batch)
                batches.append(x.batch)
                writers.submit(x)
            writers.join()
    # calls of at most 8 tokens, each cut into parts for the writer threads, in order
    assert sum(batches, []) == list(range(len(prompts)))
    assert len(b.llm.threads) == 1 and next(iter(b.llm.threads)).startswith("eyrie-generate")
    assert list((tmp_path / "scratch").iterdir()) == []  # every request file removed
    assert b.waits["engine_s"] > 0 and b.waits["read_s"] > 0
    tol = dict(rtol=1e-2, atol=0) if storage == "bfloat16" else dict(rtol=0.07, atol=0)
    with ShardReader(tmp_path / "s.h5") as r:
        for i, p in enumerate(prompts):
            got, want = r.read(i), torch.tensor(p).float()[:, None]
            final, aux = got["final_hidden"].float(), got["aux_hidden"].float()
            torch.testing.assert_close(final, (want + 0.3).expand(-1, 8), **tol)
            torch.testing.assert_close(aux[:, 8:16], (want + 0.1).expand(-1, 8), **tol)


def test_a_stopped_extraction_closes_the_calls_request_files(tmp_path, monkeypatch):
    """The consumer stops after the first part of a call (as Extractor does on a bad batch):
    the call's other parts are released, so its request files are closed."""
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: kw))
    b = _capture_backend(tmp_path, [1, 2], 4)
    states = b.states([np.array([1, 2, 3], np.int32), np.array([4, 5], np.int32)], torch.bfloat16)
    first = next(states)
    first.release()
    states.close()
    assert first.free.left == 0 and all(f.fd == -1 for f in first.free.files)


def test_a_request_file_for_other_tokens_is_one_clear_line(tmp_path, monkeypatch):
    from eyrie.core.errors import ExtractError

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: kw))
    b = _capture_backend(tmp_path, [1, 2], 4)
    real = b.llm.generate

    def wrong_tokens(prompts, params, use_tqdm=False):
        outs = real(prompts, params)
        path = next(tmp_path.iterdir())
        arrays = {k: v.copy() for k, v in read_request(path).items()}
        arrays["token_ids"][0] += 1
        write_request(path, arrays)
        return outs

    b.llm.generate = wrong_tokens
    with pytest.raises(ExtractError, match="other token ids than the 3-token prompt"):
        list(b.states([np.array([1, 2, 3], dtype=np.int32)], torch.bfloat16))
    (tmp_path / "junk.safetensors").write_bytes(b"\x01")
    with pytest.raises(ExtractError, match="junk.safetensors: not a readable request file"):
        read_request(tmp_path / "junk.safetensors")


def test_generate_calls_keep_order_and_the_token_bound():
    """The driver's generate() calls: samples in order, at most the bound's tokens per call, and
    a sample longer than the bound alone in its call (never split, never dropped)."""
    from eyrie.extract.vllm_backend import generate_calls

    lengths = [10, 20, 5, 40, 1, 1, 30]
    calls = generate_calls(lengths, 32)
    assert calls == [[0, 1], [2], [3], [4, 5, 6]]  # 1 + 1 + 30: exactly the bound
    assert [i for call in calls for i in call] == list(range(len(lengths)))
    assert generate_calls([], 32) == []
