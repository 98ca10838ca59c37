"""Block drafters (DFlash, DSpark) built with speculators' own classes for a target folder, and
trained on eyrie's packs: the same shards and batches as EAGLE-3 (issue 40's first part)."""

from __future__ import annotations

import json

import pytest
import torch

from eyrie.arch.draft import DraftSpec, mask_token
from eyrie.core.errors import EyrieError
from eyrie.formats.report import shard_expectation
from eyrie.train.packing import PackedShards
from tests.support.train_helpers import AUX_IDS, BLOCK, block_draft


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_block_drafter_trains_on_eyries_packs(world, method):
    """speculators' model of the method, fed an eyrie pack (the aux states concatenated, the
    final state, ids, loss mask, document and position ids) with its own training arguments:
    a finite loss, accuracy per block position, gradients on the draft's weights only (the
    target's embedding and lm_head rows stay frozen), the config of the method vLLM serves."""
    model = block_draft(world, method)
    assert model.config.speculators_model_type == method
    assert model.config.block_size == BLOCK
    assert model.config.aux_hidden_state_layer_ids == list(AUX_IDS)
    train_kwargs, _ = type(model).get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", max_anchors=16
    )
    data = PackedShards(
        world["shards"], shard_expectation(world["preflight"]), 128, gap=0, shifted=False
    )
    try:
        _, loss, metrics = model(**data.batch([0, 1]), **train_kwargs)
    finally:
        data.close()
    assert torch.isfinite(loss) and loss > 0
    first = 0 if method == "dspark" else 1  # dspark also predicts at the block's anchor
    positions = {f"position_{k}_acc_sum" for k in range(first, BLOCK)}
    assert positions <= set(metrics)
    loss.backward()
    trained = [n for n, p in model.named_parameters() if p.grad is not None and p.grad.any()]
    assert trained and any(n.startswith("layers.0.") for n in trained)
    assert model.embed_tokens.weight.grad is None and model.lm_head.weight.grad is None


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_the_same_seed_builds_the_same_block_drafter(world, method):
    one, two = block_draft(world, method, seed=3), block_draft(world, method, seed=3)
    other = block_draft(world, method, seed=4)
    names = [n for n, p in one.named_parameters() if p.requires_grad]
    assert all(torch.equal(one.state_dict()[n], two.state_dict()[n]) for n in names)
    assert not all(torch.equal(one.state_dict()[n], other.state_dict()[n]) for n in names)


def test_a_block_drafter_without_a_mask_token_is_refused():
    with pytest.raises(EyrieError, match="dflash draft needs a mask token id"):
        DraftSpec(AUX_IDS, method="dflash")
    with pytest.raises(EyrieError, match="draft method 'medusa'"):
        DraftSpec(AUX_IDS, method="medusa")


def test_the_mask_token_is_the_tokenizers_else_the_first_free_row(world):
    """The tokenizer's own mask token; else the first embedding row past its ids (what
    speculators' added <|MASK|> would take); else its pad token when that is a token of its own;
    else one line naming the folder and the key to set."""
    tok = world["tokenizer"]
    assert mask_token(tok, len(tok) + 64, "target-x") == len(tok)
    assert mask_token(tok, len(tok), "target-x") == tok.pad_token_id  # <|pad|>: never text
    shared = type(tok).from_pretrained(world["target"])
    shared.pad_token = shared.eos_token  # as many published tokenizers pad
    with pytest.raises(
        EyrieError,
        match=r"target-x: the tokenizer has no mask token, no pad token of its own.*"
        r"set train.mask_token_id",
    ):
        mask_token(shared, len(shared), "target-x")
    masked = type(tok).from_pretrained(world["target"])
    masked.add_special_tokens({"mask_token": "<|mask|>"})
    assert mask_token(masked, len(masked), "target-x") == masked.mask_token_id


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_the_training_step_trains_a_block_drafter(world, method):
    """eyrie's own step (eyrie.train.step.Stepper: forward and backward of each pack, clipping,
    AdamW) drives a block drafter through its kind (eyrie.train.kinds): over repeated steps on
    the same packs the loss falls, and the sums hold an accuracy per drafted token and no
    per-position loss (NaN), which the step records turn into None."""
    from eyrie.config.sections import TrainSettings
    from eyrie.train.kinds import block_kind
    from eyrie.train.launch import Dist
    from eyrie.train.metrics import read_pending
    from eyrie.train.model import Trainable
    from eyrie.train.step import Stepper
    from tests.support.train_helpers import train_settings

    cfg = TrainSettings.from_settings(train_settings(max_grad_norm=10.0))
    model = block_draft(world, method)
    model.train()
    kind = block_kind(model, cfg.loss, max_anchors=16)
    assert (kind.method, kind.positions) == (method, BLOCK - (method == "dflash"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    draft = Trainable(model, params, optimizer, schedule, kind)
    stepper = Stepper(cfg, draft, model, torch.device("cpu"), Dist(), 1, False, None)
    data = PackedShards(
        world["shards"], shard_expectation(world["preflight"]), 128, gap=0, shifted=False
    )
    try:
        batches = [data.batch([0, 1, 2])]
        losses, pending = [], []
        for step in range(12):
            torch.manual_seed(step)  # the same anchors at every step: one fixed objective
            sums, norm = stepper.step(batches)
            losses.append(float(sums[0]))
            pending.append(
                (
                    {
                        "step": step,
                        "epoch": 0,
                        "tokens": (1, 1),
                        "lr": 3e-3,
                        "data_wait_s": 0.0,
                        "wall_s": 0.0,
                    },
                    sums,
                    norm,
                )
            )
    finally:
        data.close()
    assert losses[-1] < 0.7 * losses[0], losses
    record = read_pending(pending[-1:], 1, kind.positions)[0]
    assert all(record[f"loss_{k}"] is None for k in range(kind.positions))
    assert all(0.0 <= record[f"full_acc_{k}"] <= 1.0 for k in range(kind.positions))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_block_drafter_trains_exports_and_evaluates_through_the_stages(world, tmp_path, method):
    """train.method picks the kind of draft; the train, export and evaluate stages take it from
    there: training records accuracy per drafted token (block_size - 1 for dflash, all slots for
    dspark), the export writes the block drafter's config as speculators and vLLM read it and
    loads back with identical outputs, and the Hugging Face evaluation decodes with the block
    proposer (its outputs equal the target's greedy ones) at K up to the block's tokens."""
    from eyrie.export.export import export
    from eyrie.formats.draft import BLOCK_CONFIG_FIELDS, load_draft
    from eyrie.train.recipe import train
    from tests.support.train_helpers import evaluate_on, train_paths, train_settings

    settings = train_settings(epochs=1, method=method, block_size=BLOCK)
    positions = BLOCK if method == "dspark" else BLOCK - 1
    settings["eval"] = {"num_speculative_tokens": positions, "max_new_tokens": 12, "device": "cpu"}
    summary = train(train_paths(world, tmp_path), settings)
    assert summary["method"] == method
    assert len(summary["final"]["full_acc"]) == positions
    records = (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()
    assert f'"full_acc_{positions - 1}"' in records[-1] and '"loss_0": null' in records[-1]

    out = tmp_path / "draft"
    export(world["target"], tmp_path / "train", out, settings)
    config = json.loads((out / "config.json").read_text())
    assert all(config.get(f) is not None for f in BLOCK_CONFIG_FIELDS)
    assert config["speculators_model_type"] == config["speculators_config"]["algorithm"] == method
    assert config["aux_hidden_state_layer_ids"] == list(AUX_IDS)
    assert config["block_size"] == BLOCK
    assert config["mask_token_id"] == world["tokenizer"].pad_token_id  # no mask token, no free row
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == positions
    assert type(load_draft(out)).__name__ == type(load_draft(tmp_path / "train" / "draft")).__name__

    got = evaluate_on(world, out, tmp_path, settings, prompts=3)
    assert got["K"] == positions and got["outputs_match_target_greedy"]
    assert len(got["trained"]["acceptance_length_by_k"]) == positions
    assert 1.0 <= got["trained"]["acceptance_length"] <= 1 + positions


def test_the_dspark_papers_loss_is_a_train_loss_setting(world):
    """train.loss {ce: 0.1, tv: 0.9} (the DSpark paper's 0.1 CE + 0.9 TV) reaches speculators'
    DSpark as its compound loss, with the confidence head's BCE that it adds: the loss and
    each term are finite and reported."""
    from eyrie.config.sections import loss_spec
    from eyrie.train.kinds import block_kind

    model = block_draft(world, "dspark")
    kind = block_kind(model, loss_spec({"ce": 0.1, "tv": 0.9}))
    data = PackedShards(
        world["shards"], shard_expectation(world["preflight"]), 128, gap=0, shifted=False
    )
    try:
        _, loss, metrics = model(**data.batch([0, 1]), **kind.call)
    finally:
        data.close()
    assert torch.isfinite(loss) and loss > 0
    for term in ("ce", "tv", "confidence"):
        assert torch.isfinite(torch.as_tensor(metrics[f"{term}_loss_sum"])), term
    assert "kl_div_loss_sum" not in metrics


@pytest.mark.slow
def test_a_resumed_dspark_run_draws_the_same_anchors(world, tmp_path, monkeypatch):
    """Exact resume as for EAGLE-3: a DSpark run cut at step 6 and resumed from its step-4
    checkpoint ends with the uninterrupted run's weights, with anchors subsampled at random
    (8 per pack here: speculators draws them from torch's generator, which the checkpoint
    restores)."""
    from functools import partial

    import eyrie.train.model as model_module
    from eyrie.train.kinds import block_kind
    from eyrie.train.recipe import train
    from tests.support.train_helpers import (
        assert_weights,
        cut_and_resumed,
        train_paths,
        train_settings,
        weights,
    )

    monkeypatch.setattr(model_module, "block_kind", partial(block_kind, max_anchors=8))
    settings = train_settings(epochs=2, checkpoint_every=4, method="dspark", block_size=BLOCK)
    full, cut = cut_and_resumed(world, tmp_path, settings)  # resumes from step 4
    assert_weights(full, cut, exact=True)
    other = tmp_path / "other"
    train(train_paths(world, other), {"train": {**settings["train"], "seed": 1}})
    moved = weights(other)
    assert not all(torch.equal(full[k], moved[k]) for k in full)  # the check can fail
