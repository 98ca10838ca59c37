"""benchmarks/quality.py on the tiny config, on the CPU: a real workflow run for eyrie's draft, its
shards converted for speculators and its loader built from the flags the peer would train with
(speculators' trainer itself needs a GPU), then two recipe variants in the same folder, the second
retraining only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.support import REPO
from tests.support.stages import demo_conversations

pytestmark = pytest.mark.slow  # two real workflow runs and speculators' loader: minutes


def test_quality_benchmark_peer_and_recipe_on_the_tiny_config(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    convs = demo_conversations(work / "c.jsonl")
    assert convs.returncode == 0, convs.stderr
    base = yaml.safe_load((REPO / ".test" / "config.yaml").read_text())
    base["data"]["conversations"] = [str(work / "c.jsonl")]
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(base))
    common = ["--base-config", str(tmp_path / "tiny.yaml"), "--workdir", str(work), "--k", "1", "2"]
    script = str(REPO / "benchmarks" / "quality.py")

    peer = subprocess.run(
        [sys.executable, script, "peer", *common, "--out", str(tmp_path / "peer.json")]
        + [
            "--peer",
            "speculators",
            "--peer",
            "spec_nonorm=--no-norm-output",
            "--peer-steps",
            "auto",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert peer.returncode == 0, peer.stdout[-3000:] + peer.stderr[-3000:]
    r = json.loads((tmp_path / "peer.json").read_text())
    eyrie, spec = r["rows"]["eyrie"], r["rows"]["speculators"]
    assert eyrie["steps"] > 0 and eyrie["tokens"] > 0
    assert r["peer_steps"] == eyrie["steps"]  # `auto`: eyrie's plan, read before it trained
    assert set(eyrie["al"]) == {"1", "2"} and all(1 <= c["hf"] <= 3 for c in eyrie["al"].values())
    assert eyrie["engine"]["hf"] == {"name": "hf", "dtype": "float32", "device": "cpu"}
    assert spec["not_run"].startswith("speculators.train needs a CUDA device")
    assert spec["batches_per_epoch"] > 0 and spec["samples"] > 0
    s = spec["settings"]
    assert s["max_steps"] == eyrie["steps"] and s["total_seq_len"] == 256
    assert s["optimizer"] == "muon" and s["loss_fn"] == "kl_div" and s["ttt_steps"] == 3
    assert "| eyrie |" in peer.stdout
    nonorm = r["rows"]["spec_nonorm"]  # a second peer: the common flags and its own
    assert (
        nonorm["flags_beyond_common"] == ["--no-norm-output"] and spec["flags_beyond_common"] == []
    )
    assert nonorm["settings"]["norm_output"] is False and s["norm_output"] is True
    assert nonorm["samples"] == spec["samples"] and (work / "peer_data.json").exists()

    recipe = subprocess.run(
        [sys.executable, script, "recipe", *common, "--out", str(tmp_path / "recipe.json")]
        + ["--variant", "ref", "--variant", "ce", "train.loss=ce", "train.lr_schedule=linear"]
        + ["--variant", "spark", "train.method=dspark"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert recipe.returncode == 0, recipe.stdout[-3000:] + recipe.stderr[-3000:]
    rows = json.loads((tmp_path / "recipe.json").read_text())["rows"]
    assert rows["ref"]["al"]["2"]["hf"] == eyrie["al"]["2"]["hf"]  # the peer run's draft, reused
    log = (work / "ce.snakemake.log").read_text()
    assert "train_draft" in log and "extract_hidden_states" not in log  # retrained only
    assert rows["ce"]["overrides"] == ["train.loss=ce", "train.lr_schedule=linear"]
    assert "| ce | train.loss=ce train.lr_schedule=linear |" in recipe.stdout
    # each variant against the first, paired by prompt (the same held-out prompts)
    assert rows["ref"]["paired"] is None
    for name in ("ce", "spark"):
        pair = rows[name]["paired"]
        assert pair["ratio"] == pytest.approx(
            rows[name]["al"]["2"]["hf"] / rows["ref"]["al"]["2"]["hf"]
        )
        assert pair["ci95"][0] <= pair["ratio"] <= pair["ci95"][1]
    spark = (work / "spark.snakemake.log").read_text()
    assert "train_draft" in spark and "extract_hidden_states" not in spark  # a block drafter
    assert all(1 <= c["hf"] <= 3 for c in rows["spark"]["al"].values())  # from the same shards
