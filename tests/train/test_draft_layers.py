"""train.aux_ids: a draft reads some of the layers the shards hold, so one extraction of several
layers trains drafts of every kind (issue 40's wider shards). The batch carries those layers'
columns only, the draft and its export name them, and the evaluation captures them."""

from __future__ import annotations

import json

import pytest
import torch

from eyrie.config.sections import TrainSettings
from eyrie.core.errors import EyrieError
from eyrie.formats.report import shard_expectation
from eyrie.train.packing import PackedShards
from tests.support.train_helpers import AUX_IDS, HIDDEN, train_paths, train_settings


def test_the_batch_holds_the_columns_of_the_layers_a_draft_reads(world):
    """Layers [3, 1] of shards holding [1, 2, 3]: each token's states are the stored blocks of
    layer 3 then layer 1, as read from the same packs without a selection."""
    expect = shard_expectation(world["preflight"])
    every = PackedShards(world["shards"], expect, 128, gap=2)
    some = PackedShards(world["shards"], expect, 128, gap=2, layers=[3, 1])
    try:
        a, b = every.batch([0, 1]), some.batch([0, 1])
    finally:
        every.close()
        some.close()
    blocks = a["hidden_states"].view(1, -1, len(AUX_IDS), HIDDEN)
    want = torch.cat([blocks[..., 2, :], blocks[..., 0, :]], dim=-1)
    assert b["hidden_states"].shape[-1] == 2 * HIDDEN
    assert torch.equal(b["hidden_states"], want)
    for key in a:
        if key != "hidden_states":
            assert torch.equal(a[key], b[key]), key


def test_a_layer_the_shards_lack_is_one_line_naming_them(world):
    cfg = TrainSettings.from_settings(train_settings(aux_ids=[1, 4]))
    with pytest.raises(EyrieError, match=r"train.aux_ids \[1, 4\]: layers \[4\] are not in the"):
        cfg.draft_layers(AUX_IDS, "preflight.json")
    assert TrainSettings.from_settings(train_settings()).draft_layers(AUX_IDS, "p") == AUX_IDS


def test_an_eagle3_draft_trained_on_two_of_three_stored_layers_exports_and_evaluates(
    world, tmp_path
):
    """train.aux_ids [1, 3] of shards holding [1, 2, 3]: the draft's fc reads 2 x H, the run
    and the export name [1, 3], and the Hugging Face evaluation captures those two layers."""
    from eyrie.export.export import export
    from eyrie.train.recipe import train
    from tests.support.train_helpers import evaluate_on

    settings = train_settings(epochs=1, aux_ids=[1, 3])
    settings["eval"] = {"max_new_tokens": 8, "device": "cpu"}
    summary = train(train_paths(world, tmp_path), settings)
    assert summary["aux_layer_ids"] == [1, 3] and summary["stored_layer_ids"] == AUX_IDS
    out = tmp_path / "draft"
    export(world["target"], tmp_path / "train", out, settings)
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    got = evaluate_on(world, out, tmp_path, settings, prompts=2)
    assert got["aux_layer_ids"] == [1, 3] and got["outputs_match_target_greedy"]
