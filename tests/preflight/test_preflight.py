"""Preflight: the report's layer ids and storage, tokenizer/chat template, weights, safety (how
the target and its layer ids are read: tests/arch/test_target.py)."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple

import pytest

from eyrie.cli import main
from eyrie.core import errors as pf_errors
from eyrie.preflight import checks as pf_checks
from eyrie.preflight import preflight as pf
from tests.support.stages import stage_args


def copy_target(src, dst):
    shutil.copytree(src, dst)
    return dst


def write_report(path, tokens=1000, assistant=400):
    shards = [
        {"tokens": tokens // 2, "assistant_tokens": assistant // 2},
        {"tokens": tokens - tokens // 2, "assistant_tokens": assistant - assistant // 2},
    ]
    path.write_text(json.dumps({"shards": shards}))
    return path


def test_ok_report_has_resolved_ids_and_storage(chat_target, tmp_path):
    report = pf.preflight(chat_target, write_report(tmp_path / "r.json"), tmp_path, {})
    assert report["ok"] is True
    assert report["aux_layer_ids"] == [2, 4, 5] and report["final_layer_id"] == 8
    assert report["storage"]["bytes_per_token"] == 4 * 32 * 2
    assert report["storage"]["estimated_bytes"] == 1000 * 4 * 32 * 2
    assert report["target"]["tokenizer_hash"]


def test_no_assistant_tokens_refused(chat_target, tmp_path):
    with pytest.raises(pf_errors.PreflightError, match="no assistant tokens"):
        pf.preflight(chat_target, write_report(tmp_path / "r.json", assistant=0), tmp_path, {})


def test_cli_writes_report(chat_target, tmp_path):
    out = tmp_path / "preflight.json"
    report = write_report(tmp_path / "r.json")
    settings = {"layers": {"aux_ids": [1, 3, 6]}}
    argv = stage_args(
        "preflight", target=chat_target, tokenize_report=report, out=out, settings=settings
    )
    rc = main(argv)
    assert rc == 0
    assert json.loads(out.read_text())["aux_layer_ids"] == [1, 3, 6]


def test_cli_failure_writes_nothing_and_one_line_per_problem(chat_target, tmp_path, capsys):
    out = tmp_path / "preflight.json"
    settings = {"layers": {"aux_ids": [3, 3]}}
    rc = main(stage_args("preflight", target=chat_target, out=out, settings=settings))
    assert rc == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "layers.aux_ids=[3, 3]: duplicate ids" in err


def test_remote_code_needs_opt_in(chat_target, tmp_path):
    path = copy_target(chat_target, tmp_path / "t")
    cfg = json.loads((path / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(pf_errors.PreflightError, match="set target.trust_remote_code: true"):
        pf.preflight(path, None, tmp_path, {})


def test_pickle_only_weights_refused(chat_target, tmp_path):
    path = copy_target(chat_target, tmp_path / "t")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(pf_errors.PreflightError, match="only in pickle files"):
        pf.preflight(path, None, tmp_path, {})


def test_weights_without_what_training_reads_refused(chat_target, tmp_path):
    """A checkpoint whose tensors lack the embeddings (or, untied, the lm_head) that training
    reads from the target: one line in preflight naming the file and the tensor, not a KeyError
    in training."""
    from safetensors.torch import load_file, save_file

    path = copy_target(chat_target, tmp_path / "t")
    tensors = load_file(path / "model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if "embed_tokens" not in k}, path / "model.safetensors"
    )
    with pytest.raises(pf_errors.PreflightError) as err:
        pf.preflight(path, None, tmp_path, {})
    (line,) = [p for p in str(err.value).splitlines() if "embed_tokens" in p]
    assert f"{path}: no tensor named *embed_tokens.weight (nor tok_embeddings.weight" in line
    assert "copy the complete checkpoint" in line and "vllm.rehearsal: true" in line
    save_file(
        {k: v for k, v in tensors.items() if k != "lm_head.weight"}, path / "model.safetensors"
    )
    with pytest.raises(pf_errors.PreflightError, match="no tensor named \\*lm_head.weight"):
        pf.preflight(path, None, tmp_path, {})
    report = pf.preflight(chat_target, None, tmp_path, {})
    assert report["weights"] == {"files": 1, "bytes": report["weights"]["bytes"], "checked": True}


def test_identity_keeps_to_the_template_traits_of_finished_runs(chat_target, tmp_path):
    """Traits preflight reports since (the tool-argument form, the stop tokens) leave the identity
    that keys the store and the training run id as it was."""
    from eyrie.formats.report import identity

    report = pf.preflight(chat_target, None, tmp_path, {})
    before = {
        **report,
        "chat_template": {
            k: report["chat_template"][k]
            for k in ("prefix_stable", "generation_marks", "renders_reasoning", "auto_mode")
        },
    }
    assert set(report["chat_template"]) > set(before["chat_template"])
    assert identity(report) == identity(before)
    flipped = {**before, "chat_template": {**before["chat_template"], "auto_mode": "per_turn"}}
    assert identity(flipped) != identity(before)


def test_all_zero_loss_mask_template_refused(chat_target, tmp_path):
    path = copy_target(chat_target, tmp_path / "t")
    # A template that drops assistant turns entirely: nothing for the draft to learn.
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}\n"
        "{% endif %}{% endfor %}"
    )
    with pytest.raises(pf_errors.PreflightError, match="chat template"):
        pf.preflight(path, None, tmp_path, {})


def test_missing_chat_template_refused(chat_target, tmp_path):
    path = copy_target(chat_target, tmp_path / "t")
    (path / "chat_template.jinja").unlink()
    with pytest.raises(pf_errors.PreflightError, match="no chat template"):
        pf.preflight(path, None, tmp_path, {})


def test_too_little_disk(chat_target, tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(
        pf_checks.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 10**6, 10**6)
    )
    with pytest.raises(pf_errors.PreflightError, match=r"need ~0\.26 GB .* only 0\.00 GB are free"):
        pf.preflight(chat_target, write_report(tmp_path / "r.json", tokens=1_000_000), tmp_path, {})


def test_all_problems_reported_at_once(chat_target, tmp_path):
    path = copy_target(chat_target, tmp_path / "t")
    (path / "model.safetensors").unlink()
    (path / "chat_template.jinja").unlink()
    with pytest.raises(pf_errors.PreflightError) as err:
        pf.preflight(path, None, tmp_path, {"layers": {"aux_ids": [9]}})
    text = str(err.value)
    assert "3 problem(s)" in text
    assert "out of range" in text and "no *.safetensors" in text and "no chat template" in text


@pytest.mark.parametrize(
    "exc",
    [RuntimeError(), AssertionError(), KeyError("")],
    ids=["RuntimeError", "AssertionError", "KeyError"],
)
def test_cli_unexpected_error_logs_type_and_traceback(tmp_path, monkeypatch, caplog, exc):
    """An exception without a message must not become an empty log line."""

    def fail(args):
        raise exc

    monkeypatch.setattr(pf, "run", fail)
    with caplog.at_level("ERROR", logger="eyrie.cli"):
        rc = main(["preflight", "--target", str(tmp_path), "--out", str(tmp_path / "p.json")])
    assert rc == 1
    (record,) = [r for r in caplog.records if r.name == "eyrie.cli"]
    text = record.getMessage()
    name = type(exc).__name__
    assert text.startswith(f"eyrie preflight: unexpected {name}: ")
    assert "Traceback (most recent call last)" in text and "in fail" in text
    assert text.rstrip().splitlines()[-1].startswith(name)


def test_cli_user_error_without_message_names_its_type(tmp_path, monkeypatch, capsys):
    def fail(args):
        raise pf_errors.PreflightError()

    monkeypatch.setattr(pf, "run", fail)
    assert main(["preflight", "--target", str(tmp_path), "--out", str(tmp_path / "p.json")]) == 2
    assert "eyrie preflight: error: PreflightError (no message)" in capsys.readouterr().err
