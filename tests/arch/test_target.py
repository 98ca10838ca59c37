"""The target as eyrie reads it (eyrie/arch/target.py): the architecture from config.json (a
multimodal wrapper's text config), unknown ones refused naming the supported, and the layer ids
whose hidden states the draft reads (layers.aux_ids, or the default [2, N//2, N-3])."""

from __future__ import annotations

import json

import pytest

from eyrie.arch.target import inspect_target, resolve_layer_ids
from eyrie.core.errors import TargetError
from tests.support.vllm_helpers import KIMI_K25


@pytest.mark.parametrize(
    "ids, message",
    [
        ([2, 2, 5], "duplicate ids"),
        ([2, 4, 8], "id 8 is out of range for a 8-layer target"),
        ([0, 4, 5], "id 0 is out of range"),
        ([5, 4, 6], "not increasing"),
    ],
)
def test_bad_aux_ids(ids, message):
    with pytest.raises(TargetError, match=message):
        resolve_layer_ids(ids, 8)


def test_default_ids_invalid_for_tiny_targets_names_the_formula():
    with pytest.raises(TargetError, match=r"default \[2, N//2, N-3\] = \[2, 2, 1\] for N=4"):
        resolve_layer_ids(None, 4)
    assert resolve_layer_ids(None, 61) == ([2, 30, 58], 61)


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with pytest.raises(
        TargetError, match=r"'mamba' is not supported; supported: deepseek_v2, .*llama"
    ):
        inspect_target(tmp_path)


def test_multimodal_wrapper_reads_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K25))
    info = inspect_target(tmp_path)
    assert (info.model_type, info.wrapper_model_type) == ("kimi_k2", "kimi_k25")
    assert (info.num_hidden_layers, info.hidden_size) == (61, 7168)
    assert info.needs_remote_code
    assert resolve_layer_ids(None, info.num_hidden_layers) == ([2, 30, 58], 61)
