"""vLLM architecture adapters and the facts preflight checks them against.

vLLM's internals move every release (the embedding method was renamed, DeepSeek's decoder layer takes
a positional `llama_4_scaling`, the native extraction path captures before or after a layer depending
on the architecture). eyrie keeps what it relies on in ONE registry keyed by the target's model_type
(text_config's for multimodal wrappers) and checks it against the INSTALLED vLLM on a CPU, in
seconds, before any GPU job (eyrie.vllm.preflight_checks), and again inside the worker when the capture
path installs itself (eyrie.vllm.capture).

This module imports nothing from vLLM at import time: `gather_facts` does, in the vLLM environment
(`python -m eyrie.vllm.gather --config config.json` prints the facts as JSON).

Two ways to get hidden states out of vLLM (docs/vllm.md):
- native: vLLM's own `extract_hidden_states` speculative method + `ExampleHiddenStatesConnector`
  (vLLM >= 0.18), one safetensors file per request;
- capture: a worker extension (eyrie.vllm.capture) that replaces the language model's forward with
  the adapter's loop below and records the residual stream at the chosen ids.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from eyrie.errors import VllmAdapterError

# vLLM versions eyrie supports: [low, high). Tested ones and how: docs/vllm.md.
SUPPORTED_VLLM = ((0, 18, 0), (0, 23, 0))


TESTED_VLLM = {
    "0.22.0": "H200: both extraction paths and eagle3 evaluation; CPU: introspection in CI"
}


NATIVE_METHOD = "extract_hidden_states"


NATIVE_CONNECTOR = "ExampleHiddenStatesConnector"


EMBED_METHODS = ("embed_input_ids", "get_input_embeddings")  # newest name first (renamed in 0.12)


PATHS = ("auto", "native", "capture")


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
    # extra per-forward layer arguments (keys of EXTRA_ARGS), passed after the core ones
    extras: tuple[str, ...] = ()
    layers_attr: str = "layers"
    norm_attr: str = "norm"
    # a layer returns (hidden_states, residual); hidden + residual is the residual stream
    returns: str = "pair"
    # config attributes the adapter relies on: attribute -> allowed values (None: any, but present)
    config_requires: tuple[tuple[str, tuple | None], ...] = ()

    @property
    def core_params(self) -> tuple[str, ...]:
        return self.layer_params


LLAMA_PARAMS = ("positions", "hidden_states", "residual")


_DEEPSEEK = VllmAdapter(
    "deepseek",
    "deepseek_v2",
    "DeepseekV2Model",
    "DeepseekV2DecoderLayer",
    ("positions", "hidden_states", "residual", "llama_4_scaling"),
    "positional",
    extras=("llama_4_scaling",),
    # vLLM builds DeepSeek-style MoE routing from these; a tiny config without them fails to load
    # ("...mlp.gate.e_score_correction_bias", REFERENCE §5)
    config_requires=(("scoring_func", ("sigmoid", "softmax")), ("topk_method", None)),
)


ADAPTERS: dict[str, VllmAdapter] = {
    "llama": VllmAdapter(
        "llama", "llama", "LlamaModel", "LlamaDecoderLayer", LLAMA_PARAMS, "keyword"
    ),
    "mistral": VllmAdapter(
        "mistral", "mistral", "MistralModel", "MistralDecoderLayer", LLAMA_PARAMS, "keyword"
    ),
    "qwen2": VllmAdapter(
        "qwen2", "qwen2", "Qwen2Model", "Qwen2DecoderLayer", LLAMA_PARAMS, "keyword"
    ),
    "qwen3": VllmAdapter(
        "qwen3", "qwen3", "Qwen3Model", "Qwen3DecoderLayer", LLAMA_PARAMS, "keyword"
    ),
    "qwen3_moe": VllmAdapter(
        "qwen3_moe", "qwen3_moe", "Qwen3MoeModel", "Qwen3MoeDecoderLayer", LLAMA_PARAMS, "keyword"
    ),
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": _DEEPSEEK,
    "kimi_k2": _DEEPSEEK,  # Kimi-K2 / K2.5's text_config: DeepseekV3-shaped
    "gpt_oss": VllmAdapter(
        "gpt_oss",
        "gpt_oss",
        "GptOssModel",
        "TransformerBlock",
        ("hidden_states", "positions", "residual"),
        "keyword",
    ),
}


def supported() -> str:
    return ", ".join(sorted(ADAPTERS))


def adapter_for(model_type: str) -> VllmAdapter:
    try:
        return ADAPTERS[model_type]
    except KeyError:
        raise VllmAdapterError(
            f"model_type {model_type!r} has no vLLM adapter; supported: "
            f"{supported()} (docs/vllm.md: adding an architecture)"
        ) from None


def llama_4_scaling(config, positions, module):
    """DeepSeek-family attention scaling: computed by vLLM's own helper when the config asks for it
    (Mistral-Large-3-style configs), None when the config has no `llama_4_scaling` (Kimi-K2.5)."""
    spec = getattr(config, "llama_4_scaling", None)
    if spec is None:
        return None
    helper = getattr(module, "_get_llama_4_scaling")
    return helper(
        original_max_position_embeddings=spec["original_max_position_embeddings"],
        scaling_beta=spec["beta"],
        positions=positions,
    )


EXTRA_ARGS = {"llama_4_scaling": llama_4_scaling}


EXTRA_HELPERS = {"llama_4_scaling": "_get_llama_4_scaling"}  # what each needs from the vLLM module


# the keyword arguments each helper is called with above
EXTRA_HELPER_PARAMS = {
    "llama_4_scaling": ("original_max_position_embeddings", "scaling_beta", "positions")
}


def call_layer(adapter: VllmAdapter, layer, positions, hidden, residual, extras: dict):
    """One decoder layer, called the way the adapter says; returns (hidden, residual)."""
    values = {"positions": positions, "hidden_states": hidden, "residual": residual, **extras}
    if adapter.call == "positional":
        out = layer(*(values[p] for p in adapter.layer_params))
    else:
        out = layer(**{p: values[p] for p in adapter.layer_params})
    if not (isinstance(out, tuple) and len(out) == 2):
        raise VllmAdapterError(
            f"{type(layer).__name__} returned {type(out).__name__}, expected "
            "(hidden_states, residual); the adapter's `returns` is wrong for "
            "this vLLM"
        )
    return out


def request_key(token_ids) -> str:
    """Name of a prompt's capture file: a hash of its token ids (int64)."""
    return hashlib.sha1(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:20]
