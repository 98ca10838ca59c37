"""Preflight's prediction of the GPU memory a vLLM engine asks for at its start, per GPU: the
weights, the activations of vLLM's memory-profiling step (`determine_available_memory` runs one
forward of `max_num_batched_tokens` tokens and samples `max_num_seqs` rows over the vocabulary),
memory outside torch's allocator, and the KV cache of one `max_model_len` sequence, which vLLM
refuses to start without. All of it must fit vllm.gpu_memory_gib x vllm.gpu_memory_utilization;
vLLM gives what is left to more KV cache. The activations are counted from the architecture: the
largest set of tensors one decoder layer holds at once, per token. docs/vllm.md (GPU memory)
says what each term is and BENCHMARKS.md how the prediction compares with vLLM's own figures.
"""

from __future__ import annotations

from eyrie.config.sections import VllmSettings

GIB = 1024**3
ACTIVATION_BYTES = 2  # bfloat16 activations (the engines' dtype for every target eyrie runs)
# memory a CUDA process takes outside torch's allocator while vLLM profiles (cuBLAS workspaces,
# NCCL buffers, the allocator's fragmentation): vLLM counts it as `non_torch_increase`
OTHER_GIB = 1.0
# bytes per (row, vocabulary entry) while vLLM's profiling samples: the logits in float32, their
# sorted copy with int64 indices, and the probabilities (the sampler's top-k/top-p path)
SAMPLER_BYTES = 4 + 4 + 8 + 4


def _text(config: dict) -> dict:
    return config.get("text_config") or config


def kv_bytes_per_token(config: dict, tp: int) -> int:
    """Bytes of KV cache per token per GPU over every layer: MLA keeps one latent of
    kv_lora_rank + qk_rope_head_dim per layer on every GPU; other attention K and V of the KV
    heads on that GPU (at least one: vLLM replicates them when tp exceeds their count)."""
    t = _text(config)
    layers = t["num_hidden_layers"]
    if t.get("kv_lora_rank"):
        return layers * (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * ACTIVATION_BYTES
    heads = t["num_attention_heads"]
    kv = t.get("num_key_value_heads") or heads
    head_dim = t.get("head_dim") or t["hidden_size"] // heads
    return layers * 2 * max(1, kv // tp) * head_dim * ACTIVATION_BYTES


def _attention_elements(t: dict, tp: int) -> int:
    """Elements per token that one attention block holds at once on one GPU."""
    heads = t["num_attention_heads"] // tp or 1
    if t.get("kv_lora_rank"):  # MLA prefill: q, the latent, K and V expanded per head, output
        nope, rope, v = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
        q_lora = t.get("q_lora_rank") or 0
        return (
            q_lora
            + heads * (nope + rope)  # q
            + t["kv_lora_rank"]
            + rope  # the latent and the shared rope key
            + heads * (nope + v)  # kv_b_proj's output
            + heads * (nope + rope)  # K with the rope part
            + heads * v  # V
            + heads * v  # attention output
        )
    kv = max(1, (t.get("num_key_value_heads") or t["num_attention_heads"]) // tp)
    head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    return (heads + 2 * kv) * head_dim + heads * head_dim  # q, k, v, output


def _mlp_elements(t: dict, tp: int) -> int:
    """Elements per token that one MLP holds at once on one GPU: gate and up, the activation;
    for routed experts each token's top-k copies of those and of the output (the fused MoE
    kernels' caches), the router's float32 logits and the shared experts."""
    experts = t.get("n_routed_experts") or t.get("num_experts") or t.get("num_local_experts")
    dense = 3 * t["intermediate_size"] // tp
    if not experts:
        return dense
    size = t.get("moe_intermediate_size") or t["intermediate_size"]
    topk = t.get("num_experts_per_tok") or t.get("moe_topk") or 1
    shared = int(t.get("n_shared_experts") or 0) * 3 * size // tp
    routed = topk * (3 * size // tp + t["hidden_size"])
    return max(dense, routed + 2 * experts + shared)


def activation_bytes(config: dict, tp: int, tokens: int, rows: int) -> dict:
    """The profiling step's peak activations on one GPU: the forward of `tokens` tokens (the
    residual stream and the layer's input, plus the larger of the attention's and the MLP's
    tensors) or, while the forward's hidden states are kept, the sampling of `rows` rows."""
    t = _text(config)
    hidden = t["hidden_size"]
    per_token = 2 * hidden + max(_attention_elements(t, tp), _mlp_elements(t, tp))
    forward = tokens * per_token * ACTIVATION_BYTES
    sampler = tokens * hidden * ACTIVATION_BYTES + rows * t["vocab_size"] * SAMPLER_BYTES
    return {
        "forward_bytes_per_token": per_token * ACTIVATION_BYTES,
        "forward": forward,
        "sampler": sampler,
        "peak": max(forward, sampler),
    }


def predict(config: dict, v: VllmSettings, engine: dict, weights_per_gpu: float) -> dict:
    """The memory an engine with `engine`'s lengths (eyrie.vllm.engine.bounds) asks for on each
    GPU, in GiB, against the budget; `fits`."""
    tp = v.tensor_parallel_size
    act = activation_bytes(config, tp, engine["max_num_batched_tokens"], engine["max_num_seqs"])
    kv = kv_bytes_per_token(config, tp) * engine["max_model_len"]
    need = weights_per_gpu + act["peak"] + OTHER_GIB * GIB + kv
    budget = v.gpu_memory_gib * v.gpu_memory_utilization * GIB
    return {
        "weights_gib": round(weights_per_gpu / GIB, 3),
        "activations_gib": round(act["peak"] / GIB, 3),
        "activation_bytes_per_token": act["forward_bytes_per_token"],
        "other_gib": OTHER_GIB,
        "kv_cache_min_gib": round(kv / GIB, 3),
        "need_gib": round(need / GIB, 3),
        "budget_gib": round(budget / GIB, 3),
        "kv_cache_gib": round((budget - need + kv) / GIB, 3),
        "fits": need <= budget,
    }


def misfit(
    stage: str, engine: dict, longest: int, got: dict, v: VllmSettings, min_tp: int | None
) -> str:
    """The line for an engine that does not fit: the figure and the fixes (`longest`: the
    sequence the data need, which a max_model_len set by hand may exceed)."""
    fixes = []
    if engine["max_model_len"] > longest:
        fixes.append(
            f"vllm.max_model_len: null (now {engine['max_model_len']}; the data need {longest})"
        )
    if engine["max_num_batched_tokens"] > max(longest, engine["max_model_len"] // 2):
        fixes.append(
            f"a smaller vllm.max_num_batched_tokens (now {engine['max_num_batched_tokens']})"
        )
    if min_tp and min_tp > v.tensor_parallel_size:
        fixes.append(f"vllm.tensor_parallel_size={min_tp}")
    fixes.append("a higher vllm.gpu_memory_utilization")
    return (
        f"vllm: the {stage} engine would ask for ~{got['need_gib']:.1f} GiB per GPU (weights "
        f"{got['weights_gib']:.1f} + activations {got['activations_gib']:.1f} for "
        f"max_num_batched_tokens={engine['max_num_batched_tokens']} + KV cache "
        f"{got['kv_cache_min_gib']:.1f} for one max_model_len={engine['max_model_len']} sequence "
        f"+ {got['other_gib']:.1f} outside torch) but vllm.gpu_memory_gib={v.gpu_memory_gib:g} x "
        f"vllm.gpu_memory_utilization={v.gpu_memory_utilization:g} = {got['budget_gib']:.1f} GiB; "
        f"use {' or '.join(fixes)} (docs/vllm.md, GPU memory)"
    )


def batch_problem(stage: str, engine: dict) -> str | None:
    """Without chunked prefill (extraction) a prompt goes in one step: the step must hold the
    longest one, or vLLM refuses to start."""
    if engine["max_num_batched_tokens"] >= engine["max_model_len"]:
        return None
    return (
        f"vllm.max_num_batched_tokens={engine['max_num_batched_tokens']} is below the {stage} "
        f"engine's max_model_len={engine['max_model_len']} ({engine['from']}), and extraction "
        "runs each sample in one step; raise it to at least max_model_len or leave it null"
    )
