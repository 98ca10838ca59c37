"""The architecture registry: one entry per target model_type (text_config's for wrappers).

An entry holds what the Hugging Face backend needs (where the decoder layers and final norm are)
and what the vLLM capture path needs (`VllmAdapter`: vLLM's classes and how to call a layer).
A variant of an architecture is an override of its entry (`dataclasses.replace`). Standard
library only: the vLLM environment imports it. Adding an architecture: docs/vllm.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from eyrie.core.errors import TargetError, VllmAdapterError


@dataclass(frozen=True)
class VllmAdapter:
    """How the capture path drives one family's language model in vLLM."""

    family: str
    module: str  # under vllm.model_executor.models
    model_class: str  # the decoder stack: embeddings, layers, final norm
    layer_class: str
    # the decoder layer's forward parameters after self, in order, that the adapter passes
    layer_params: tuple[str, ...]
    call: str  # "keyword" | "positional": how the adapter calls a layer
    # extra per-forward layer arguments (keys of eyrie.vllm.adapters.EXTRA_ARGS), after the core
    extras: tuple[str, ...] = ()
    layers_attr: str = "layers"
    norm_attr: str = "norm"
    # a layer returns (hidden_states, residual); hidden + residual is the residual stream
    returns: str = "pair"
    # config attributes the adapter relies on: attribute -> allowed values (None: any, but present)
    config_requires: tuple[tuple[str, tuple | None], ...] = ()


@dataclass(frozen=True)
class Architecture:
    model_type: str
    family: str  # dense | moe | mla-moe
    # transformers model_type that builds the language model (kimi_k2 is DeepseekV3-shaped)
    hf_model_type: str
    vllm: VllmAdapter | None = None  # None: the vLLM backends cannot drive it
    layers_path: str = "model.layers"
    final_norm_path: str = "model.norm"


LLAMA_PARAMS = ("positions", "hidden_states", "residual")


def _keyword_adapter(module: str, model_class: str, layer_class: str) -> VllmAdapter:
    """A family whose layers take LLAMA_PARAMS by keyword."""
    return VllmAdapter(module, module, model_class, layer_class, LLAMA_PARAMS, "keyword")


_DEEPSEEK = VllmAdapter(
    "deepseek",
    "deepseek_v2",
    "DeepseekV2Model",
    "DeepseekV2DecoderLayer",
    ("positions", "hidden_states", "residual", "llama_4_scaling"),
    "positional",
    extras=("llama_4_scaling",),
    # vLLM builds DeepSeek-style MoE routing from these; without them a model fails to load
    # ("...mlp.gate.e_score_correction_bias")
    config_requires=(("scoring_func", ("sigmoid", "softmax")), ("topk_method", None)),
)


_DEEPSEEK_V3 = Architecture("deepseek_v3", "mla-moe", "deepseek_v3", _DEEPSEEK)


REGISTRY: dict[str, Architecture] = {
    a.model_type: a
    for a in [
        Architecture(
            "llama", "dense", "llama", _keyword_adapter("llama", "LlamaModel", "LlamaDecoderLayer")
        ),
        Architecture(
            "mistral",
            "dense",
            "mistral",
            _keyword_adapter("mistral", "MistralModel", "MistralDecoderLayer"),
        ),
        Architecture(
            "qwen2", "dense", "qwen2", _keyword_adapter("qwen2", "Qwen2Model", "Qwen2DecoderLayer")
        ),
        Architecture(
            "qwen3", "dense", "qwen3", _keyword_adapter("qwen3", "Qwen3Model", "Qwen3DecoderLayer")
        ),
        Architecture(
            "qwen3_moe",
            "moe",
            "qwen3_moe",
            _keyword_adapter("qwen3_moe", "Qwen3MoeModel", "Qwen3MoeDecoderLayer"),
        ),
        Architecture("deepseek_v2", "mla-moe", "deepseek_v2", _DEEPSEEK),
        _DEEPSEEK_V3,
        # Kimi-K2 / K2.5's text_config: DeepSeek-V3 under its own model_type
        replace(_DEEPSEEK_V3, model_type="kimi_k2"),
        Architecture(
            "gpt_oss",
            "moe",
            "gpt_oss",
            VllmAdapter(
                "gpt_oss",
                "gpt_oss",
                "GptOssModel",
                "TransformerBlock",
                ("hidden_states", "positions", "residual"),
                "keyword",
            ),
        ),
    ]
}


def supported() -> str:
    return ", ".join(sorted(REGISTRY))


def architecture_for(model_type: str, where: str) -> Architecture:
    """The entry for `model_type`; `where` (the config or model it came from) leads the error."""
    try:
        return REGISTRY[model_type]
    except KeyError:
        raise TargetError(
            f"{where}: model_type {model_type!r} is not supported; supported: {supported()}"
        ) from None


def adapter_for(model_type: str) -> VllmAdapter:
    """The vLLM adapter of `model_type`'s entry."""
    entry = REGISTRY.get(model_type)
    if entry is None or entry.vllm is None:
        driven = ", ".join(sorted(t for t, a in REGISTRY.items() if a.vllm is not None))
        raise VllmAdapterError(
            f"model_type {model_type!r} has no vLLM adapter; supported: "
            f"{driven} (docs/vllm.md: adding an architecture)"
        )
    return entry.vllm
