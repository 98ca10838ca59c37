"""Capture target hidden states in vLLM layer-id semantics with forward hooks.

Id k < N: the residual stream ENTERING decoder layer k (a pre-hook on layer k).
Id N: the last decoder layer's output BEFORE the final norm (a pre-hook on the final norm).
Hugging Face's `output_hidden_states[-1]` is taken after the norm, so it is not used.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from eyrie.arch.registry import architecture_for
from eyrie.arch.target import get_submodule


def _first_tensor(args, kwargs, name="hidden_states") -> torch.Tensor:
    if args:
        return args[0]
    return kwargs[name]


@contextlib.contextmanager
def capture_hidden_states(model, layer_ids: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, each forward of `model` fills the yielded dict {id: [B, T, H]}."""
    arch = architecture_for(model.config.model_type, type(model).__name__)
    layers = get_submodule(model, arch.layers_path)
    norm = get_submodule(model, arch.final_norm_path)
    num_layers = len(layers)
    captured: dict[int, torch.Tensor] = {}
    handles = []

    def make_hook(layer_id):
        def hook(module, args, kwargs):
            captured[layer_id] = _first_tensor(args, kwargs).detach()

        return hook

    try:
        for k in layer_ids:
            if not 0 <= k <= num_layers:
                raise ValueError(f"layer id {k} outside 0..{num_layers}")
            module = norm if k == num_layers else layers[k]
            handles.append(module.register_forward_pre_hook(make_hook(k), with_kwargs=True))
        yield captured
    finally:
        for h in handles:
            h.remove()
