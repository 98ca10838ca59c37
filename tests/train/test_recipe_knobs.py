"""The training recipe's choices (train.loss, train.lr_schedule, train.hidden_noise,
train.norm_before_fc, train.learning_rate: auto): parsed and refused by key, applied in training
as documented, and absent from the run id at the value runs trained with before the keys
existed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from eyrie.config.sections import TrainSettings, auto_learning_rate
from eyrie.core.errors import EyrieError
from eyrie.train.checkpoint import run_id
from eyrie.train.model import lr_factor
from eyrie.train.recipe import train
from eyrie.train.step import add_hidden_noise
from tests.support.train_helpers import (
    HIDDEN,
    assert_weights,
    cut_and_resumed,
    train_paths,
    train_settings,
)


def test_loss_is_a_name_or_a_weighted_sum_in_canonical_json():
    assert TrainSettings.from_settings({"train": {}}).loss == "kl_div"
    mixed = TrainSettings.from_settings({"train": {"loss": {"tv": 1, "ce": 0.25}}})
    assert mixed.loss == '{"ce": 0.25, "tv": 1.0}'
    from speculators.losses import resolve_loss_config

    assert sorted(resolve_loss_config(mixed.loss, "eager")) == ["ce", "tv"]


@pytest.mark.parametrize(
    "loss", ["kl", {"kl_div": 0}, {}, {"kl_div": 0.5, "mse": 0.5}, 3], ids=repr
)
def test_a_bad_loss_is_one_line_naming_the_key_and_the_choices(loss):
    with pytest.raises(EyrieError) as err:
        TrainSettings.from_settings({"train": {"loss": loss}})
    msg = str(err.value)
    assert f"train.loss: {loss!r} is not allowed; give one of kl_div, rkl, jsd, ce" in msg, msg


def test_lr_schedules_share_the_warmup_and_end_as_named():
    warm, total = 4, 20
    for kind in ("cosine", "linear", "constant"):
        assert [lr_factor(s, warm, total, kind) for s in range(warm)] == [0.2, 0.4, 0.6, 0.8]
        assert lr_factor(warm, warm, total, kind) == 1.0
    assert lr_factor(total, warm, total, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(total, warm, total, "linear") == 0.0
    assert lr_factor(total, warm, total, "constant") == 1.0
    mid = warm + (total - warm) // 2
    assert lr_factor(mid, warm, total, "linear") == 0.5
    assert lr_factor(mid, warm, total, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))
    with pytest.raises(EyrieError, match="train.lr_schedule: 'step' is not one of"):
        TrainSettings.from_settings({"train": {"lr_schedule": "step"}})


def test_hidden_noise_is_relative_to_each_layers_rms():
    torch.manual_seed(0)
    width = 64
    # two layers of very different scale side by side, as aux states are
    states = torch.cat([torch.randn(4096, width), 100 * torch.randn(4096, width)], -1)
    noisy = add_hidden_noise(states, 0.1, width)
    diff = (noisy - states).unflatten(-1, (2, width))
    rows = states.unflatten(-1, (2, width))
    ratio = diff.pow(2).mean(-1).sqrt() / rows.pow(2).mean(-1).sqrt()
    assert ratio.mean(0).tolist() == pytest.approx([0.1, 0.1], rel=0.05)
    states.requires_grad_(True)
    add_hidden_noise(states, 0.1, width).sum().backward()
    assert torch.equal(states.grad, torch.ones_like(states))  # noise is additive: no gradient path


def test_run_id_leaves_out_the_new_keys_at_what_earlier_runs_trained_with(world):
    def rid(**train):
        cfg = TrainSettings.from_settings(train_settings(**train))
        return run_id(cfg, world["target"], world["preflight"], world["vocab"], world["shards"])

    before = rid()
    assert (
        rid(loss="kl_div", lr_schedule="cosine", hidden_noise=0.0, norm_before_fc=False) == before
    )
    changed = {
        rid(loss="ce"),
        rid(lr_schedule="linear"),
        rid(hidden_noise=0.05),
        rid(norm_before_fc=True),
    }
    assert before not in changed and len(changed) == 4


def test_norm_before_fc_trains_and_exports_a_draft_that_has_it(world, tmp_path):
    from safetensors import safe_open

    from eyrie.cli import main as cli_main

    settings = train_settings(epochs=1, norm_before_fc=True)
    train(train_paths(world, tmp_path), settings)
    out = tmp_path / "draft"
    args = ["export", "--target", str(world["target"]), "--train-dir", str(tmp_path / "train")]
    assert cli_main([*args, "--out-dir", str(out), "--settings", json.dumps(settings)]) == 0
    assert json.loads((out / "config.json").read_text())["norm_before_fc"] is True
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "input_norm.weight" in names, sorted(names)  # speculators' norm over the aux states


def test_training_with_a_mixed_loss_noise_and_linear_schedule(world, tmp_path):
    def run(name, **recipe):
        train(train_paths(world, tmp_path / name), train_settings(epochs=3, log_every=1, **recipe))
        lines = (tmp_path / name / "train" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(ln) for ln in lines]

    plain = run("plain")
    recipe = run("recipe", loss={"kl_div": 0.5, "ce": 0.5}, hidden_noise=0.05, lr_schedule="linear")
    assert len(recipe) == len(plain)
    assert recipe[-1]["lr"] < recipe[len(recipe) // 2]["lr"] < recipe[3]["lr"]
    losses = [r["loss"] for r in recipe]
    assert all(math.isfinite(v) for v in losses)
    # it trains (CE keeps the target's entropy in its floor: the loss falls less than KL's)
    assert sum(losses[-3:]) < 0.95 * sum(losses[:3])
    assert recipe[-1]["full_acc_0"] > recipe[0]["full_acc_0"]
    assert losses[0] != plain[0]["loss"]  # another loss on other inputs from the first step


def test_a_resumed_run_with_hidden_noise_draws_the_same_noise(world, tmp_path):
    settings = train_settings(epochs=2, checkpoint_every=4, hidden_noise=0.1)
    full, cut = cut_and_resumed(world, tmp_path, settings)  # resumes from step 4
    assert_weights(full, cut, exact=True)


def test_auto_learning_rate_scales_with_the_drafts_width():
    # the two measured optima it goes through, and the widths of real targets it extrapolates to
    assert [auto_learning_rate(h) for h in (64, 128, 512, 4096, 7168)] == [
        3e-3,
        3e-3,
        1e-3,
        2e-4,
        1e-4,
    ]
    assert TrainSettings.from_settings({"train": {}}).learning_rate == "auto"
    fixed = TrainSettings.from_settings({"train": {"learning_rate": 1}})
    assert fixed.learning_rate == 1.0 and fixed.resolved_for(4096) is fixed
    with pytest.raises(EyrieError) as err:
        TrainSettings.from_settings({"train": {"learning_rate": "fast"}})
    assert "train.learning_rate: 'fast'" in str(err.value)
    assert "give a positive number such as 1.0e-3, or auto" in str(err.value)


def test_auto_learning_rate_trains_at_its_number_under_the_same_run_id(world, tmp_path):
    lr = auto_learning_rate(HIDDEN)
    settings = train_settings(epochs=1, log_every=1, lr_schedule="constant", learning_rate="auto")
    auto = TrainSettings.from_settings(settings)
    fixed = TrainSettings.from_settings({"train": {**settings["train"], "learning_rate": lr}})
    ids = {
        run_id(c, world["target"], world["preflight"], world["vocab"], world["shards"])
        for c in (auto.resolved_for(HIDDEN), fixed)
    }
    assert len(ids) == 1  # a finished run at the explicit rate resumes under auto
    summary = train(train_paths(world, tmp_path), settings)
    assert summary["learning_rate"] == lr and summary["run_id"] in ids
    last = json.loads((tmp_path / "train" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["lr"] == pytest.approx(lr)  # the optimizer's rate after the warmup
