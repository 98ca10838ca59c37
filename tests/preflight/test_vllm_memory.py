"""Preflight's engine lengths and memory prediction (eyrie.vllm.engine.bounds,
eyrie.preflight.vllm_memory) on published configs, against figures checked by hand: the KV cache
per token of Llama-3.1-8B (GQA, 8 KV heads of 128) and DeepSeek-V3 (MLA: a 512 + 64 latent per
layer), and the lengths each engine gets from the data or from the user."""

from __future__ import annotations

import pytest

from eyrie.config.sections import VllmSettings
from eyrie.preflight.vllm_memory import (
    GIB,
    activation_bytes,
    batch_problem,
    kv_bytes_per_token,
    predict,
)
from eyrie.vllm.engine import BATCH_TOKENS, EXTRACT_SEQS, GENERATE_SEQS, bounds
from tests.support.vllm_gpu_check import llama_config


def llama_8b() -> dict:
    """Llama-3.1-8B's shape (32 layers, hidden 4096, 8 KV heads of 128, MLP 14336)."""
    return llama_config("llama-3.1-8b").to_dict()


def deepseek_v3() -> dict:
    """DeepSeek-V3's published shape: transformers' DeepseekV3Config defaults are its values
    (61 layers, hidden 7168, kv_lora_rank 512, qk_rope_head_dim 64)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config().to_dict()


def test_kv_cache_per_token_of_published_targets():
    llama, deepseek = llama_8b(), deepseek_v3()
    # Llama-3.1-8B: 32 layers x K and V x 8 KV heads x 128 x 2 bytes = 128 KiB per token
    assert kv_bytes_per_token(llama, 1) == 32 * 2 * 8 * 128 * 2 == 128 * 1024
    # tensor parallel 8: one KV head per GPU; 16: still one (vLLM replicates them)
    assert kv_bytes_per_token(llama, 8) == kv_bytes_per_token(llama, 16) == 16 * 1024
    # DeepSeek-V3: 61 layers x (kv_lora_rank 512 + rope 64) x 2 bytes, whole on every GPU
    assert kv_bytes_per_token(deepseek, 1) == kv_bytes_per_token(deepseek, 8) == 61 * 576 * 2


def test_activations_grow_with_the_step_and_the_sampled_rows():
    llama = llama_8b()
    small = activation_bytes(llama, 1, 2048, 256)
    large = activation_bytes(llama, 1, 65536, 256)
    assert large["forward"] == 32 * small["forward"]
    # Llama-3.1-8B's MLP holds gate and up (2 x 14336) and the activation (14336) per token,
    # beside the residual stream and the layer's input (2 x 4096), in bfloat16
    assert small["forward_bytes_per_token"] == (2 * 4096 + 3 * 14336) * 2
    # 1,024 rows over a 128,256-token vocabulary outweigh a 2,048-token forward
    rows = activation_bytes(llama, 1, 2048, 1024)
    assert rows["peak"] == rows["sampler"] > rows["forward"]


def test_extraction_lengths_come_from_the_data_unless_set():
    v = VllmSettings.from_section({})
    got = bounds(v, 386, chunked=False, source="the longest tokenized sample")
    assert got == {
        "max_model_len": 386,
        "max_num_batched_tokens": BATCH_TOKENS,
        "max_num_seqs": EXTRACT_SEQS,
        "from": "the longest tokenized sample",
    }
    # a sample longer than the default step: the step holds it (no chunked prefill)
    assert bounds(v, 40000, chunked=False, source="x")["max_num_batched_tokens"] == 40000
    # generating engines prefill in chunks: the step stays
    long = bounds(v, 40000, chunked=True, source="x")
    assert long["max_num_batched_tokens"] == BATCH_TOKENS and long["max_num_seqs"] == GENERATE_SEQS
    # the user's values win, and say so
    mine = VllmSettings.from_section({"max_model_len": 8192, "max_num_batched_tokens": 4096})
    got = bounds(mine, 386, chunked=False, source="x")
    assert got["max_model_len"] == 8192 and got["from"] == "vllm.max_model_len"
    assert got["max_num_batched_tokens"] == 4096
    assert "raise it to at least max_model_len" in batch_problem("extraction", got)


@pytest.mark.parametrize("gib, fits", [(80, True), (24, True), (16, False)])
def test_llama_8b_fits_80_and_24_gb_gpus_not_a_16_gb_one(gib, fits):
    llama = llama_8b()
    v = VllmSettings.from_section({"gpu_memory_gib": gib})
    engine = bounds(v, 2050, chunked=False, source="x")
    weights = 16 * GIB  # Llama-3.1-8B in bfloat16, about 8.0 B parameters
    got = predict(llama, v, engine, weights)
    assert got["fits"] is fits
    assert got["need_gib"] == pytest.approx(
        got["weights_gib"] + got["activations_gib"] + got["other_gib"] + got["kv_cache_min_gib"],
        abs=0.01,
    )
    assert got["kv_cache_gib"] == pytest.approx(
        got["budget_gib"] - got["need_gib"] + got["kv_cache_min_gib"], abs=0.01
    )
