"""The embedded demo: stdlib-docstring conversations and the small CPU-trained Llama target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from eyrie.core.errors import EyrieError
from eyrie.demo.conversations import clean_summary, write_conversations
from eyrie.demo.corpus import read_conversations
from eyrie.demo.target import train_target
from tests.support.stages import options, run_stage

TINY = {
    "seed": 0,
    "num_conversations": 80,
    "vocab_size": 320,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
    "train_steps": 30,
    "batch_size": 4,
    "seq_len": 64,
    "learning_rate": 1e-2,
}


@pytest.fixture(scope="module")
def conversations_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo") / "conversations.jsonl"
    run_stage("demo-conversations", *options(out=path, settings={"demo": TINY}))
    return path


@pytest.fixture(scope="module")
def tiny_target(conversations_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("target") / "target"
    argv = options(conversations=conversations_file, out_dir=out, settings={"demo": TINY})
    run_stage("demo-target", *argv)
    return out


# ----------------------------------------------------------------------------- conversations


def test_conversations_deterministic_and_well_formed(tmp_path, conversations_file):
    again = tmp_path / "again.jsonl"
    write_conversations(
        again, {"demo": {"seed": TINY["seed"], "num_conversations": TINY["num_conversations"]}}
    )
    assert again.read_bytes() == conversations_file.read_bytes()
    other = tmp_path / "other.jsonl"
    write_conversations(
        other, {"demo": {"seed": 1, "num_conversations": TINY["num_conversations"]}}
    )
    assert other.read_bytes() != conversations_file.read_bytes()

    lines = conversations_file.read_text().splitlines()
    assert len(lines) == TINY["num_conversations"]
    records = [json.loads(line) for line in lines]
    for rec in records:
        msgs = rec["messages"]
        assert set(rec) == {"messages"}
        assert all(
            m["role"] in ("system", "user", "assistant") and m["content"].strip() for m in msgs
        )
        assert msgs[-1]["role"] == "assistant"
        body = msgs[1:] if msgs[0]["role"] == "system" else msgs
        assert [m["role"] for m in body] == ["user", "assistant"] * (len(body) // 2)
    assert any(r["messages"][0]["role"] == "system" for r in records)
    assert any(r["messages"][0]["role"] != "system" for r in records)
    assert any(len(r["messages"]) > 3 for r in records)  # multi-turn
    assert any(len(r["messages"]) <= 3 for r in records)  # single-turn
    # The answer names the object the question asked about.
    first = next(r["messages"] for r in records if r["messages"][0]["role"] == "user")
    name = first[0]["content"].split("`")[1]
    assert first[1]["content"].startswith(f"`{name}`: ")
    prov = json.loads(conversations_file.with_name("conversations.provenance.json").read_text())
    assert prov["num_conversations"] == TINY["num_conversations"]
    assert prov["num_documented_objects"] > 500


def test_clean_summary():
    doc = (
        "reduce(function, iterable[, initial]) -> value\n\n"
        "Apply a ``function`` of two\n   arguments.\n\nMore."
    )
    assert clean_summary(doc) == "Apply a `function` of two arguments."
    assert clean_summary("Short.") is None
    assert clean_summary(">>> example()\nthat is all there is") is None
    long = "First sentence is here. " + "word " * 200
    assert clean_summary(long) == "First sentence is here."


def test_bad_conversations_file_names_file_and_line(tmp_path, capsys):
    good = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(f"{good}\n{good}\n{{not json\n")
    with pytest.raises(EyrieError) as err:
        read_conversations(bad)
    msg = str(err.value)
    assert f"{bad}:3:" in msg and "\n" not in msg

    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text(
        good + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    with pytest.raises(EyrieError, match=r"no_answer.jsonl:2: no assistant turn"):
        read_conversations(no_answer)

    bad_role = tmp_path / "bad_role.jsonl"
    bad_role.write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    with pytest.raises(EyrieError, match=r"bad_role.jsonl:1: messages\[0\] needs a role"):
        read_conversations(bad_role)

    # Through the CLI: exit status 2 and one line on stderr, no traceback.
    from eyrie.cli import main

    rc = main(
        [
            "demo-target",
            "--conversations",
            str(bad),
            "--out-dir",
            str(tmp_path / "target"),
            "--settings",
            json.dumps({"demo": TINY}),
        ]
    )
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err_lines) == 1 and f"{bad}:3:" in err_lines[0], err_lines

    # The target stage refuses it before building anything.
    with pytest.raises(EyrieError, match=r"bad.jsonl:3:"):
        train_target(bad, tmp_path / "target", {"demo": TINY})
    assert not (tmp_path / "target").exists()


def test_settings_errors(tmp_path, conversations_file):
    # the schema checks the section (a missing key takes its default: tests/config/test_config.py)
    with pytest.raises(EyrieError, match="demo.num_conversations: 0 is less than the minimum of 1"):
        write_conversations(tmp_path / "c.jsonl", {"demo": {"seed": 0, "num_conversations": 0}})
    with pytest.raises(EyrieError, match="demo: missing"):
        write_conversations(tmp_path / "c.jsonl", {})
    with pytest.raises(EyrieError, match="demo.hidden_size=30 is not divisible"):
        train_target(
            conversations_file,
            tmp_path / "t",
            {"demo": {**TINY, "hidden_size": 30, "num_attention_heads": 4}},
        )
    with pytest.raises(
        EyrieError,
        match="demo.num_attention_heads=2 is not divisible by demo.num_key_value_heads=3",
    ):
        train_target(
            conversations_file, tmp_path / "t", {"demo": {**TINY, "num_key_value_heads": 3}}
        )


# ----------------------------------------------------------------------------- target


def test_weights_replaced_by_hand_in_the_demo_target_are_named(tiny_target, tmp_path):
    """The demo target is tracked by its config files; build_demo_target records its weights'
    digest, and each parse warns when model.safetensors is no longer that file."""
    import shutil

    from safetensors.torch import load_file, save_file

    from eyrie.store.fingerprint import demo_weights_changed

    folder = shutil.copytree(tiny_target, tmp_path / "target")
    assert demo_weights_changed(folder) is None
    tensors = {k: v + 0.01 for k, v in load_file(folder / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert demo_weights_changed(folder) == (
        f"{folder / 'model.safetensors'} is not the file build_demo_target wrote (its content "
        "changed), and nothing reruns for it; rebuild it with snakemake --forcerun "
        "build_demo_target, or give your own model folder as target.path"
    )


def test_tiny_target_trains_and_loads(tiny_target):
    summary = json.loads((tiny_target / "demo_training.json").read_text())
    losses = [p["loss"] for p in summary["loss_curve"]]
    assert summary["loss_curve"][-1]["step"] == TINY["train_steps"]
    assert losses[-1] < losses[0] - 1.0, losses
    assert summary["held_out_loss"] < summary["ln_vocab"]
    # the settings the stage read (eyrie.config.stages.DemoTargetSettings), the device's default
    read = {k: v for k, v in TINY.items() if k != "num_conversations"}
    assert summary["settings"] == {**read, "device": "cpu"} and summary["device"] == "cpu"
    assert summary["provenance"]["settings"] == {"demo": TINY}

    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    tok = AutoTokenizer.from_pretrained(tiny_target)
    cfg = model.config
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.model_type == "llama"
    assert cfg.tie_word_embeddings is False and cfg.max_position_embeddings >= 1024
    assert cfg.num_hidden_layers == TINY["num_hidden_layers"] and cfg.vocab_size == len(tok)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)

    messages = [{"role": "user", "content": "What does `json.dumps` do?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|start|>user\nWhat does `json.dumps` do?<|end|>\n<|start|>assistant\n"
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])  # [1, T]
    logits = model(input_ids=ids).logits  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


@pytest.mark.slow
def test_same_seed_same_weights(tiny_target, conversations_file, tmp_path):
    again = tmp_path / "again"
    train_target(conversations_file, again, {"demo": TINY})
    a, b = load_file(tiny_target / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (tiny_target / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()

    other = tmp_path / "other"
    train_target(conversations_file, other, {"demo": {**TINY, "seed": 1, "train_steps": 2}})
    c = load_file(other / "model.safetensors")
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
