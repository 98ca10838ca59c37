"""The capture path's forward and recorder (eyrie.vllm.capture) on a decoder stack shaped like
vLLM's: layers take (positions, hidden_states, residual) and update the residual IN PLACE through a
fused add-norm, the way vLLM's RMSNorm(x, residual) does. The real-vLLM run is on a GPU
(tests/vllm_gpu_check.py); this checks the id semantics, the in-place safety and the splitting of a
batched token stream into prompts, on CPU."""

from __future__ import annotations

import sys
import threading
import time
import types

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eyrie.arch.registry import REGISTRY, VllmAdapter
from eyrie.errors import VllmAdapterError
from eyrie.vllm.adapters import call_layer, request_key
from eyrie.vllm.capture import _Recorder, make_forward

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


def install(stack, ids, tmp_path):
    rec = _Recorder(ids, str(tmp_path))
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
    start = 0
    for p in prompts:
        saved = load_file(str(tmp_path / f"{request_key(p)}.safetensors"))
        assert saved["token_ids"].tolist() == p
        ref = reference_states(stack, torch.tensor(p), torch.arange(len(p)))
        for j, k in enumerate(ids):  # [T, n_ids, H]; id 0 = embeddings, id 4 = N, before the norm
            torch.testing.assert_close(saved["hidden_states"][:, j], ref[k], rtol=1e-6, atol=1e-6)
        start += len(p)


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
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{request_key(prompts[1])}.safetensors"]
    assert rec.expected == set()


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


def test_every_registered_target_family_has_an_adapter():
    assert all(
        isinstance(a.vllm, VllmAdapter) and a.vllm.call in ("keyword", "positional")
        for a in REGISTRY.values()
    )


class _FakeEngine:
    """A stand-in for vllm.LLM on the capture path: generate() writes each prompt's request file
    (states that are a function of the token ids) as the capture worker does, slowly enough
    that the next call overlaps the reading of the last one; it records its calls' threads."""

    def __init__(self, scratch, n_ids: int, H: int):
        self.scratch, self.n_ids, self.H = scratch, n_ids, H
        self.threads: set[str] = set()

    def collective_rpc(self, name, args=()):
        self.threads.add(threading.current_thread().name)
        return [[]]

    def generate(self, prompts, params, use_tqdm=False):
        from safetensors.torch import save_file

        self.threads.add(threading.current_thread().name)
        time.sleep(0.05)
        outs = []
        for n, p in enumerate(prompts):
            ids = torch.tensor(p["prompt_token_ids"], dtype=torch.int64)
            states = ids[:, None, None].float() + torch.arange(self.n_ids)[None, :, None] / 10
            states = states.expand(len(ids), self.n_ids, self.H).to(torch.bfloat16).contiguous()
            save_file(
                {"hidden_states": states, "token_ids": ids},
                str(self.scratch / f"{request_key(ids.numpy())}.safetensors"),
            )
            outs.append(types.SimpleNamespace(request_id=str(n)))
        return outs


def test_vllm_backend_reads_each_call_while_the_next_runs(tmp_path, monkeypatch):
    """VllmBackend.states on the capture path with a stand-in engine: every sample's states in
    order, the engine driven from one thread only, and a prompt that recurs in the next call
    (its request file shared by both calls) read in both."""
    from eyrie.vllm import backend as vb

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: kw))
    b = object.__new__(vb.VllmBackend)
    b.path, b.layer_ids, b.n_aux, b.H = "capture", [1, 2, 3, 4], 3, 8
    b.tokens_per_call, b.scratch, b.staging = 8, tmp_path, None
    b.llm = _FakeEngine(tmp_path, 4, 8)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8], [12, 13, 14, 15, 16], [17, 18]]
    ids = [np.array(p, dtype=np.int32) for p in prompts]
    batches = list(b.states(ids, torch.bfloat16))
    # calls of at most 8 tokens; prompt 2 is prompt 0 again, in the next call
    assert [x.batch for x in batches] == [[0, 1], [2], [3, 4]]
    for x in batches:
        for i, aux, final in zip(x.batch, x.aux, x.final):
            want = torch.tensor(prompts[i]).float()[:, None]
            assert aux.shape == (len(prompts[i]), 3 * 8) and final.shape == (len(prompts[i]), 8)
            torch.testing.assert_close(final.float(), (want + 0.3).expand(-1, 8), rtol=1e-2, atol=0)
    assert len(b.llm.threads) == 1 and next(iter(b.llm.threads)).startswith("eyrie-generate")
    assert list(tmp_path.iterdir()) == []  # every request file removed once read
