"""The real Snakemake DAG on a tiny config: one full run, then dry runs that prove only stale
outputs rebuild (Snakemake's own planner decides; we only read its job table)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile")]

TINY = {
    "target": {"name": "tiny"},
    "demo": {
        "num_conversations": 240, "vocab_size": 400, "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
        "train_steps": 12, "batch_size": 4, "seq_len": 96,
    },
    "data": {"conversations": ["convs.jsonl"], "max_seq_len": 96, "num_shards": 2, "num_eval": 4},
    "layers": {"aux_ids": [1, 2, 3]},
    "vocab": {"draft_vocab_size": 256},
    "extract": {"max_tokens_per_batch": 512},
    "train": {"epochs": 1, "max_tokens_per_batch": 256, "warmup_steps": 2, "checkpoint_every": 5},
    "eval": {"num_prompts": 2, "max_new_tokens": 8},
}


def write_config(workdir: Path, **overrides) -> Path:
    cfg = json.loads(json.dumps(TINY))
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        cfg[section][key] = value
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def snakemake(workdir: Path, *args: str, timeout: int = 600) -> str:
    cmd = [*SNAKEMAKE, "-d", str(workdir), "--configfile", str(workdir / "config.yaml"),
           "--cores", "2", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in workdir.glob("logs/**/*.log"))
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{out[-6000:]}\n{logs}")
    return out


def planned(workdir: Path, *targets: str) -> dict[str, int]:
    """Rule -> job count that a dry run plans ({} when nothing is to be done)."""
    out = snakemake(workdir, "-n", *targets)
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:", 1)[1].split("total", 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny workflow run to completion once; tests below dry-run against it."""
    work = tmp_path_factory.mktemp("wf")
    write_config(work)
    convs = subprocess.run(
        [sys.executable, "-m", "eyrie.cli", "demo-conversations", "--out", str(work / "convs.jsonl"),
         "--settings", json.dumps({"demo": {"seed": 7, "num_conversations": 60}})],
        capture_output=True, text=True)
    assert convs.returncode == 0, convs.stderr
    # Before anything is built: asking for one shard plans only what that shard needs.
    one = planned(work, "results/tiny/hidden/shard_001.h5")
    assert one == {"build_demo_conversations": 1, "build_demo_target": 1,
                   "tokenize_conversations": 1, "preflight": 1, "extract_hidden_states": 1}
    snakemake(work)
    return work


@pytest.mark.slow
def test_full_run_outputs(built):
    ev = json.loads((built / "results/tiny/eval/eval.json").read_text())
    assert ev["outputs_match_target_greedy"] is True
    for which in ("trained", "untrained"):
        assert ev[which]["num_drafts"] > 0
        assert 1.0 <= ev[which]["acceptance_length"] <= 1 + ev["K"]
    draft_cfg = json.loads((built / "results/tiny/draft/config.json").read_text())
    assert draft_cfg["speculators_model_type"] == "eagle3"
    assert draft_cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert (built / "results/tiny/eval/eval.png").stat().st_size > 0
    assert (built / "logs/tiny/train_draft.log").stat().st_size > 0


@pytest.mark.slow
def test_second_run_plans_nothing(built):
    assert planned(built) == {}


@pytest.mark.slow
def test_training_setting_reruns_only_train_export_evaluate(built):
    write_config(built, train__learning_rate=1e-3)
    try:
        assert planned(built) == {"train_draft": 1, "export_draft": 1, "evaluate_draft": 1,
                                  "all": 1}
    finally:
        write_config(built)


@pytest.mark.slow
def test_eval_setting_reruns_only_evaluation(built):
    write_config(built, eval__max_new_tokens=12)
    try:
        assert planned(built) == {"evaluate_draft": 1, "all": 1}
    finally:
        write_config(built)


@pytest.mark.slow
def test_extract_setting_reruns_extraction_not_preflight(built):
    write_config(built, extract__max_tokens_per_batch=256)
    try:
        jobs = planned(built)
    finally:
        write_config(built)
    assert jobs == {"extract_hidden_states": 2, "train_draft": 1, "export_draft": 1,
                    "evaluate_draft": 1, "all": 1}


@pytest.mark.slow
def test_aux_ids_rerun_extraction_not_tokenization(built):
    write_config(built, layers__aux_ids=[1, 3])
    try:
        jobs = planned(built)
    finally:
        write_config(built)
    assert jobs["extract_hidden_states"] == 2 and jobs["preflight"] == 1
    assert jobs["train_draft"] == 1
    assert "tokenize_conversations" not in jobs and "build_vocab_map" not in jobs
    assert "build_demo_target" not in jobs


@pytest.mark.slow
def test_edited_conversations_rerun_everything_downstream(built):
    convs = built / "convs.jsonl"
    original = convs.read_bytes()
    extra = {"messages": [{"role": "user", "content": "What does len do?"},
                          {"role": "assistant", "content": "It returns the number of items."}]}
    convs.write_bytes(original + (json.dumps(extra) + "\n").encode())
    try:
        jobs = planned(built)
    finally:
        convs.write_bytes(original)
    assert jobs == {"tokenize_conversations": 1, "build_vocab_map": 1, "preflight": 1,
                    "extract_hidden_states": 2, "train_draft": 1, "export_draft": 1,
                    "evaluate_draft": 1, "all": 1}


@pytest.mark.slow
def test_deleted_shard_rebuilds_alone(built):
    shard = built / "results/tiny/hidden/shard_000.h5"
    saved = shard.with_suffix(".saved")
    shutil.copy2(shard, saved)
    shard.unlink()
    try:
        assert planned(built, "results/tiny/hidden/shard_000.h5") == {"extract_hidden_states": 1}
    finally:
        shutil.move(saved, shard)
