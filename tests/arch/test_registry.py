"""The registry of target families (eyrie/arch/registry.py): each one says how vLLM's decoder
layer of that family is called, which the capture path (tests/extract/test_vllm_capture.py)
follows."""

from __future__ import annotations

from eyrie.arch.registry import REGISTRY, VllmAdapter


def test_every_registered_target_family_has_an_adapter():
    assert all(
        isinstance(a.vllm, VllmAdapter) and a.vllm.call in ("keyword", "positional")
        for a in REGISTRY.values()
    )
