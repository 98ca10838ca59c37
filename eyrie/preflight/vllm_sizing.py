"""Preflight's sizing of a vLLM target: its weights' bytes (from the *.safetensors, or counted
from the architecture and its quantization) against the GPUs' memory, and the tensor parallel
sizes vLLM allows for its attention heads. See docs/vllm.md (What preflight checks).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from eyrie.arch.target import TargetInfo
from eyrie.config.sections import VllmSettings

# The weights may take this fraction of tp x gpu_memory_gib x gpu_memory_utilization; the rest is
# left for activations, the KV cache and CUDA graphs (extraction runs prompts of max_model_len).
WEIGHT_FRACTION = 0.80


GIB = 1024**3


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _moe_layers(text: dict, num_layers: int) -> int:
    """How many decoder layers have routed experts (DeepSeek: first_k_dense_replace and
    moe_layer_freq; Qwen3-MoE: decoder_sparse_step and mlp_only_layers)."""
    first_dense = int(text.get("first_k_dense_replace") or 0)
    freq = int(text.get("moe_layer_freq") or text.get("decoder_sparse_step") or 1)
    dense_only = set(text.get("mlp_only_layers") or [])
    return sum(
        1
        for i in range(num_layers)
        if i >= first_dense and (i + 1) % freq == 0 and i not in dense_only
    )


def parameter_groups(text: dict) -> dict[str, int]:
    """Parameters of the language model described by a config (text_config for wrappers), by
    group: embeddings, lm_head, attention (MLA when kv_lora_rank is set), dense MLPs, routed and
    shared experts, routers. Biases and norms are left out (< 0.1%); vision towers too."""
    H, L, V = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    nh = text["num_attention_heads"]
    nkv = text.get("num_key_value_heads") or nh
    if text.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)
        qr, kr = text.get("q_lora_rank"), text["kv_lora_rank"]
        dn, dr, dv = text["qk_nope_head_dim"], text["qk_rope_head_dim"], text["v_head_dim"]
        q = H * qr + qr * nh * (dn + dr) if qr else H * nh * (dn + dr)
        attn = q + H * (kr + dr) + kr * nh * (dn + dv) + nh * dv * H
    else:
        hd = text.get("head_dim") or H // nh
        attn = H * nh * hd + 2 * H * nkv * hd + nh * hd * H
    experts = (
        text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts")
    )
    moe = _moe_layers(text, L) if experts else 0
    size = (text.get("moe_intermediate_size") or text["intermediate_size"]) if experts else 0
    shared = int(text.get("n_shared_experts") or 0)
    return {
        "embed_tokens": V * H,
        "lm_head": 0 if text.get("tie_word_embeddings") else V * H,
        "attention": L * attn,
        "dense_mlp": (L - moe) * 3 * H * text["intermediate_size"],
        "experts": moe * (experts or 0) * 3 * H * size,
        "shared_experts": moe * shared * 3 * H * size,
        "router": moe * H * (experts or 0),
    }


def count_parameters(text: dict) -> int:
    """All parameters of parameter_groups."""
    return sum(parameter_groups(text).values())


# a module of each group of Linear layers as checkpoints name them: a quantization config's
# ignore list (names, or "re:" patterns matched from the start) is tested against these
GROUP_MODULES = {
    "lm_head": "lm_head",
    "attention": "model.layers.3.self_attn.o_proj",
    "dense_mlp": "model.layers.0.mlp.down_proj",
    "experts": "model.layers.3.mlp.experts.0.down_proj",
    "shared_experts": "model.layers.3.mlp.shared_experts.down_proj",
}


def quantized_bits(q: dict) -> tuple[float, list[str]] | None:
    """Bits per parameter of a checkpoint's quantized Linear weights (their scales included) and
    the modules left unquantized; None for a method this does not know."""
    method = q.get("quant_method")
    if method == "compressed-tensors":
        group = next(iter((q.get("config_groups") or {}).values()), None) or {}
        weights = group.get("weights") or {}
        bits, size = weights.get("num_bits"), weights.get("group_size")
        if not isinstance(bits, int):
            return None
        return bits + (16 / size if size else 0), list(q.get("ignore") or [])
    if method == "fp8":
        block = q.get("weight_block_size") or [128, 128]
        skip = q.get("ignored_layers") or q.get("modules_to_not_convert") or []
        return 8 + 32 / (block[0] * block[1]), list(skip)
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
        bits, size = q.get("bits") or q.get("w_bit"), q.get("group_size") or q.get("q_group_size")
        if not isinstance(bits, int):
            return None
        return bits + (16 + bits) / size if size else bits, list(
            q.get("modules_to_not_convert") or []
        )
    return None


def _ignored(module: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif module == pattern or module.endswith("." + pattern):
            return True
    return False


def architecture_bytes(config: dict) -> dict:
    """The weights' bytes from the architecture: parameters x bytes per parameter, quantized
    Linear groups at their quantization's bits (the ignore list's groups and the rest at the
    checkpoint dtype); `upper_bound` when the quantization method is unknown."""
    text = config.get("text_config") or config
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"
    per = DTYPE_BYTES.get(str(dtype), 2)
    groups = parameter_groups(text)
    q = text.get("quantization_config") or config.get("quantization_config")
    quant = quantized_bits(q) if isinstance(q, dict) else None
    total = 0.0
    for group, n in groups.items():
        module = GROUP_MODULES.get(group)
        if quant is not None and module is not None and not _ignored(module, quant[1]):
            total += n * quant[0] / 8
        else:
            total += n * per
    params = sum(groups.values())
    how = f"{params / 1e9:.2f} B parameters, {dtype}"
    if quant is not None:
        how += f", {q['quant_method']} at {quant[0]:g} bits"
    elif q:
        how += f"; quantized ({q.get('quant_method')}), so this is an upper bound"
    return {
        "bytes": int(total),
        "parameters": params,
        "how": how,
        "upper_bound": bool(q) and not quant,
    }


# the *.safetensors' bytes against the architecture's: below PARTIAL_SHARE they are taken for a
# copy in progress (the architecture's figure is used); below COMPLETE_SHARE they are used, with a
# warning (a partial copy, or a quantization config.json does not declare)
PARTIAL_SHARE, COMPLETE_SHARE = 0.1, 0.5


def weight_bytes(target: Path, config: dict) -> dict:
    """Bytes of the weights vLLM loads: the *.safetensors files as stored, or, with no files (a
    rehearsal while the weights download) or far fewer bytes than the architecture needs, the
    architecture's own figure (architecture_bytes). `mismatch`: a warning when the two disagree."""
    files = sorted(Path(target).glob("*.safetensors"))
    stored = sum(f.stat().st_size for f in files)
    try:
        arch = architecture_bytes(config)
    except (KeyError, TypeError) as exc:
        if not files:
            return {
                "bytes": None,
                "upper_bound": True,
                "source": f"no *.safetensors in {target} and config.json lacks {exc} to count "
                "parameters",
            }
        arch = None
    share = stored / arch["bytes"] if arch and arch["bytes"] else 1.0
    if files and share >= PARTIAL_SHARE:
        out = {
            "bytes": stored,
            "source": f"{len(files)} *.safetensors file(s) in {target}",
            "upper_bound": False,
        }
    else:
        out = {
            "bytes": arch["bytes"],
            "parameters": arch["parameters"],
            "upper_bound": arch["upper_bound"],
            "source": f"the architecture in config.json ({arch['how']})",
        }
    if arch is not None:
        out["architecture_bytes"] = arch["bytes"]
    if files and share < COMPLETE_SHARE and not arch["upper_bound"]:
        used = "the architecture's" if share < PARTIAL_SHARE else "the files'"
        out["mismatch"] = (
            f"{target}: its *.safetensors hold {stored / GIB:.1f} GiB of the "
            f"~{arch['bytes'] / GIB:.1f} GiB the architecture in config.json needs "
            f"({arch['how']}): a copy in progress, or a quantization config.json does not "
            f"declare; the memory check uses {used} figure"
        )
    return out


def memory_check(
    target: Path, config: dict, v: VllmSettings, info: TargetInfo | None = None
) -> tuple[dict, list[str], list[str]]:
    """(estimate, problems, warnings): weights against WEIGHT_FRACTION of the GPUs' budget. The
    suggested tensor_parallel_size is the smallest that fits and that the heads allow (`info`)."""
    tp, gib, util = v.tensor_parallel_size, v.gpu_memory_gib, v.gpu_memory_utilization
    w = weight_bytes(target, config)
    budget = tp * gib * util * GIB
    allowed = WEIGHT_FRACTION * budget
    if w["bytes"] is None:
        return (
            {**w, "budget_gib": round(budget / GIB, 3), "fits": None},
            [],
            [f"weight memory not estimated: {w['source']}"],
        )
    notes = [w["mismatch"]] if w.get("mismatch") else []
    need = max(1, math.ceil(w["bytes"] / (WEIGHT_FRACTION * gib * util * GIB)))
    if info is not None:  # None: no tensor_parallel_size the attention heads allow is enough
        need = next((t for t in range(need, need + 4096) if not parallel_problems(info, t)), None)
    est = {
        **w,
        "weights_gib": round(w["bytes"] / GIB, 3),
        "weights_per_gpu_gib": round(w["bytes"] / tp / GIB, 3),
        "budget_gib": round(budget / GIB, 3),
        "weight_fraction": WEIGHT_FRACTION,
        "fits": w["bytes"] <= allowed,
        "min_tensor_parallel_size": need,
    }
    if est["fits"]:
        return est, [], notes
    text = (
        f"{target}: the weights need ~{w['bytes'] / GIB:.1f} GiB ({w['source']}) but "
        f"vllm.tensor_parallel_size={tp} x vllm.gpu_memory_gib={gib:g} x "
        f"vllm.gpu_memory_utilization={util:g} = {budget / GIB:.1f} GiB leaves "
        f"{allowed / GIB:.1f} GiB for them ({WEIGHT_FRACTION:.0%}; the rest is for activations "
        "and the KV cache); "
        + (
            f"use vllm.tensor_parallel_size={need} (GPUs of that memory) or larger GPUs "
            "(vllm.gpu_memory_gib)"
            if need is not None
            else "no tensor_parallel_size the attention heads allow is enough: use GPUs with more "
            "memory (vllm.gpu_memory_gib)"
        )
    )
    return (est, [], [*notes, text]) if w["upper_bound"] else (est, [text], notes)


def parallel_problems(info: TargetInfo, tp: int) -> list[str]:
    """vLLM's rules: attention heads % tp == 0; KV heads split (kv % tp == 0) or replicated
    (tp % kv == 0)."""
    where = "config.json: " + ("text_config." if info.wrapper_model_type else "")
    out = []
    heads = info.text_config.get("num_attention_heads")
    kv = info.text_config.get("num_key_value_heads")
    if isinstance(heads, int) and heads % tp:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        out.append(
            f"vllm.tensor_parallel_size={tp} does not divide {where}num_attention_heads="
            f"{heads}; use one of {ok[:12]}"
        )
    if isinstance(kv, int) and kv > 0 and kv % tp and tp % kv:
        out.append(
            f"vllm.tensor_parallel_size={tp}: {where}num_key_value_heads={kv} can be neither "
            f"split ({kv} % {tp} != 0) nor replicated ({tp} % {kv} != 0) across the GPUs; use "
            "a tensor_parallel_size that divides or is a multiple of it"
        )
    return out
