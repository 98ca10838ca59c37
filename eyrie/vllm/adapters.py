"""What the vLLM backends rely on inside vLLM, beside each architecture's adapter.

The supported vLLM versions, the native extraction path's names, the extra per-forward layer
arguments and the vLLM helpers that compute them, how a decoder layer is called, and the name of
a prompt's capture file. The adapters themselves are the registry's (eyrie.arch.registry).
Imports nothing from vLLM. See docs/vllm.md.
"""

from __future__ import annotations

import hashlib

import numpy as np

from eyrie.arch.registry import VllmAdapter
from eyrie.errors import VllmAdapterError

# vLLM versions eyrie supports: [low, high). Tested ones and how: docs/vllm.md.
SUPPORTED_VLLM = ((0, 18, 0), (0, 23, 0))


TESTED_VLLM = {
    "0.22.0": "H200: both extraction paths and eagle3 evaluation; CPU: introspection in CI"
}


NATIVE_METHOD = "extract_hidden_states"


NATIVE_CONNECTOR = "ExampleHiddenStatesConnector"


# the decoder stack's embedding method, newest name first
EMBED_METHODS = ("embed_input_ids", "get_input_embeddings")


PATHS = ("auto", "native", "capture")


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
