"""What the vLLM backends rely on inside vLLM, beside each architecture's adapter.

The supported vLLM versions, the native extraction path's names, the extra per-forward layer
arguments and the vLLM helpers that compute them, how a decoder layer is called, and the name of
a prompt's capture file. The adapters themselves are the registry's (eyrie.arch.registry).
Imports nothing from vLLM. See docs/vllm.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np

from eyrie.arch.registry import VllmAdapter
from eyrie.core.errors import VllmAdapterError

# vLLM versions eyrie supports: [low, high). Tested ones and how: docs/vllm.md.
SUPPORTED_VLLM = ((0, 18, 0), (0, 35, 0))


# version -> how eyrie tested it; each is installed by scripts/setup-vllm.sh (envs/vllm*.txt) and
# its facts are pinned per version by tests/vllm/test_vllm_versions.py
TESTED_VLLM = {
    "0.22.0": "H200: both extraction paths and eagle3 evaluation; CPU: its facts, in CI",
    "0.26.0": "H200: both extraction paths and eagle3 evaluation; CPU: its facts, in CI",
    "0.33.0": "CPU: its facts, in CI (it pins torch 2.14, which the GPU image cannot carry)",
    "0.34.0": "CPU: its facts, in CI (torch 2.14 as 0.33; V2 runner only; installed without its "
    "dependencies, envs/vllm-0.34.txt)",
}


GPU_TESTED_VLLM = ("0.22.0", "0.26.0")


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


# the architecture class's method for its default EAGLE-3 aux layers, newest name first
EAGLE3_DEFAULT_LAYERS = (
    "get_eagle3_default_aux_hidden_state_layers",
    "get_eagle3_aux_hidden_state_layers",
)


# The modules of vLLM's two GPU model runners. eyrie's engines (extraction, evaluation,
# regeneration) set no runner: each runs on the one the installed vLLM picks
# (VllmConfig.use_v2_model_runner; a fact: VllmFacts.default_runner), as `vllm serve` does. From
# 0.26 that is V2 for dense targets; vLLM itself keeps V1 for what its V2 lacks (0.26-0.33: most
# MoE targets, the native path's extract_hidden_states method), and 0.34 has V2 only. A
# VLLM_USE_V2_MODEL_RUNNER in the user's environment wins (0.34 refuses 0).
V1_RUNNER, V2_RUNNER = "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"


def runner_modules() -> tuple[bool, bool]:
    """(V1 runner module present, V2 runner module present), found without importing them."""

    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            return False

    return found(V1_RUNNER), found(V2_RUNNER)


def text_only(target) -> dict:
    """The engine argument that leaves a multimodal wrapper's vision tower out (Kimi-K2.5:
    config.json with a text_config): eyrie's engines feed token ids only, and the tower would
    take memory and profiling time for nothing."""
    config = json.loads((Path(target) / "config.json").read_text())
    return {"language_model_only": True} if config.get("text_config") else {}
