"""Config validation: every error at once, each naming its key; defaults filled."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eyrie.errors import ConfigError
from eyrie.settings import load_config, validate_config

REPO = Path(__file__).resolve().parent.parent


def test_shipped_config_is_valid():
    cfg = load_config(REPO / "config" / "config.yaml")
    assert cfg["target"]["path"] is None and cfg["layers"]["aux_ids"] is None


def test_defaults_filled():
    cfg = validate_config(
        {
            "target": {"name": "x"},
            "data": {},
            "layers": {},
            "vocab": {},
            "extract": {},
            "train": {},
            "eval": {},
        }
    )
    assert cfg["train"]["ttt_steps"] == 3 and cfg["extract"]["storage_dtype"] == "bfloat16"


def test_all_errors_reported_each_naming_its_key():
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["train"]["learning_rate"] = -1
    cfg["extract"]["storage_dtype"] = "int8"
    cfg["layers"]["aux_ids"] = "2,4"
    cfg["vocab"]["draft_vocab"] = 10
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    text = str(err.value)
    assert "4 problems" in text
    for key in (
        "train.learning_rate",
        "extract.storage_dtype",
        "layers.aux_ids",
        "vocab.draft_vocab: unknown key",
    ):
        assert key in text


def test_invalid_config_fails_snakemake_parse(tmp_path):
    import subprocess
    import sys

    (tmp_path / "bad.yaml").write_text("train: {epochs: 0}\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-s",
            str(REPO / "Snakefile"),
            "-d",
            str(tmp_path),
            "--configfile",
            str(tmp_path / "bad.yaml"),
            "-n",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "train.epochs" in proc.stdout + proc.stderr
