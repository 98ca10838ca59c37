"""Export: the folder round-trips through speculators' loader with identical outputs, every
config field is explicit, and drafts vLLM would serve differently are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from eyrie.cli import main as cli_main
from eyrie.core.errors import ExportError
from eyrie.export.export import export
from eyrie.formats.draft import (
    CONFIG_FIELDS,
    draft_outputs,
    load_draft,
    random_packed_batch,
)
from eyrie.train.recipe import train
from tests.support.train_helpers import (
    AUX_IDS,
    DRAFT_VOCAB,
    HIDDEN,
    build_world,
    train_paths,
    train_settings,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    world = build_world(root, num_conversations=8)
    settings = train_settings(epochs=1, ttt_steps=2)
    train(
        train_paths(world, root),
        settings,
    )
    return world, root / "train", settings


def check_config(config: dict, world: dict) -> None:
    """Every field explicit; the values the export sets."""
    for field in CONFIG_FIELDS:
        assert config.get(field) is not None, field
    assert config["speculators_model_type"] == "eagle3"
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert config["target_hidden_size"] == HIDDEN and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert config["norm_before_residual"] is True
    assert config["norm_output"] is False and config["fc_norm"] is False
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 2  # train.ttt_steps
    assert spec["verifier"] == {
        "name_or_path": str(world["target"].resolve()),
        "architectures": ["LlamaForCausalLM"],
    }


def check_tensors(path, V: int) -> None:
    """The draft's tensors at their shapes (target vocabulary V), no verifier_* ones."""
    with safe_open(str(path), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["fc.weight"] == (HIDDEN, 3 * HIDDEN)
    assert shapes["lm_head.weight"] == (DRAFT_VOCAB, HIDDEN)
    assert shapes["embed_tokens.weight"] == (V, HIDDEN)
    assert shapes["norm.weight"] == (HIDDEN,)
    assert shapes["d2t"] == (DRAFT_VOCAB,) and shapes["t2d"] == (V,)
    assert any(k.startswith("layers.0.") for k in shapes)
    assert not any(k.startswith("verifier_") for k in shapes)


def test_export_round_trip(trained, tmp_path):
    world, train_dir, settings = trained
    out = tmp_path / "draft"
    rc = cli_main(
        [
            "export",
            "--target",
            str(world["target"]),
            "--train-dir",
            str(train_dir),
            "--out-dir",
            str(out),
            "--settings",
            json.dumps(settings),
        ]
    )
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "config.py",
        "model.safetensors",
        "provenance.json",
    ]
    check_config(json.loads((out / "config.json").read_text()), world)
    check_tensors(out / "model.safetensors", len(world["tokenizer"]))

    # An independent client: speculators' loader, against the draft that training saved.
    from speculators.models.eagle3 import Eagle3DraftModel

    assert isinstance(load_draft(out), Eagle3DraftModel)
    trained_model = load_draft(train_dir / "draft")
    exported = load_draft(out)
    batch = random_packed_batch(trained_model, seed=3)
    a, b = draft_outputs(trained_model, batch, 2), draft_outputs(exported, batch, 2)
    assert set(a) == {"logits_0", "logits_1", "tokens_0", "tokens_1", "loss"}
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert a["logits_0"].shape == (1, batch["input_ids"].shape[1], DRAFT_VOCAB)
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["num_speculative_tokens"] == 2 and prov["settings"] == settings


def test_num_speculative_tokens_override(trained, tmp_path):
    world, train_dir, settings = trained
    export(world["target"], train_dir, tmp_path / "draft", settings, num_speculative_tokens=5)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5


@pytest.mark.parametrize("flag", ["norm_output", "fc_norm"])
def test_flags_vllm_ignores_are_refused(trained, tmp_path, flag):
    world, train_dir, settings = trained
    copy = tmp_path / "train"
    shutil.copytree(train_dir, copy)
    cfg_path = copy / "draft" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg[flag] = True
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=rf"{flag} is true, but vLLM 0\.22 does not read {flag}"):
        export(world["target"], copy, tmp_path / "draft", settings)
    assert not (tmp_path / "draft").exists()


def test_export_refuses_another_target(trained, tmp_path):
    world, train_dir, settings = trained
    other = tmp_path / "other"
    shutil.copytree(world["target"], other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5 if cfg.get("rms_norm_eps") != 1e-5 else 1e-6
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="trained for target fingerprint"):
        export(other, train_dir, tmp_path / "draft", settings)


def test_validation_catches_changed_weights_and_tensor_sets(trained, tmp_path):
    from safetensors.torch import load_file, save_file

    from eyrie.formats.draft import validate_export

    world, train_dir, settings = trained
    out = tmp_path / "draft"
    export(world["target"], train_dir, out, settings)
    reference = load_draft(train_dir / "draft", verifier=world["target"].resolve())
    expect = {"speculators_config.proposal_methods.0.speculative_tokens": 2}
    validate_export(out, reference, 2, expect)  # the untouched export passes
    with pytest.raises(ExportError, match="speculative_tokens is 2, expected 3"):
        validate_export(
            out, reference, 2, {"speculators_config.proposal_methods.0.speculative_tokens": 3}
        )

    tensors = load_file(str(out / "model.safetensors"))
    original = tensors["fc.weight"]
    tensors["fc.weight"] = original.clone()
    tensors["fc.weight"][0, 0] += 1e-3
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"\['fc.weight'\] differ from the trained draft's"):
        validate_export(out, reference, 2, expect)
    # equal weights, another behaviour: the outputs tell (a config flag the export must keep)
    tensors["fc.weight"] = original
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    validate_export(out, reference, 2, expect)
    config = json.loads((out / "config.json").read_text())
    config["norm_before_residual"] = not config.get("norm_before_residual", False)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="gives different"):
        validate_export(out, reference, 2, {})

    tensors["verifier_norm.weight"] = torch.ones(HIDDEN)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"unexpected \['verifier_norm.weight'\]"):
        validate_export(out, reference, 2, expect)
