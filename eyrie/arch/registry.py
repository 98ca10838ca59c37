"""eyrie.arch.registry: TODO docstring."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    model_type: str
    family: str  # dense | moe | mla-moe
    # transformers model_type that builds the language model (kimi_k2 is DeepseekV3-shaped)
    hf_model_type: str
    layers_path: str = "model.layers"
    final_norm_path: str = "model.norm"


REGISTRY: dict[str, Architecture] = {
    a.model_type: a
    for a in [
        Architecture("llama", "dense", "llama"),
        Architecture("mistral", "dense", "mistral"),
        Architecture("qwen2", "dense", "qwen2"),
        Architecture("qwen3", "dense", "qwen3"),
        Architecture("qwen3_moe", "moe", "qwen3_moe"),
        Architecture("deepseek_v2", "mla-moe", "deepseek_v2"),
        Architecture("deepseek_v3", "mla-moe", "deepseek_v3"),
        Architecture("kimi_k2", "mla-moe", "deepseek_v3"),
        Architecture("gpt_oss", "moe", "gpt_oss"),
    ]
}


def supported() -> str:
    return ", ".join(sorted(REGISTRY))
