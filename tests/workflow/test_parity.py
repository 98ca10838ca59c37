"""scripts/parity.py: run-describing fields are ignored, any change of an output is named."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import h5py
import numpy as np

from tests.support import REPO

spec = importlib.util.spec_from_file_location("parity", REPO / "scripts" / "parity.py")
parity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(parity)


def make_results(root: Path, producer: str, when: str) -> Path:
    (root / "vocab").mkdir(parents=True)
    (root / "vocab" / "vocab.safetensors").write_bytes(bytes(range(64)))
    (root / "hidden").mkdir()
    with h5py.File(root / "hidden" / "shard_000.h5", "w") as f:
        f.attrs["producer"] = producer
        f.attrs["hidden_size"] = 4
        f["aux_hidden"] = np.arange(12, dtype=np.uint16).reshape(3, 4)
        f["sample_ids"] = np.array([b"a", b"b"], dtype=object)
    (root / "train").mkdir()
    (root / "train" / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 2.5, "wall_s": 0.1}) + "\n"
    )
    (root / "eval").mkdir()
    (root / "eval" / "eval.json").write_text(
        json.dumps({"trained": {"acceptance_length": 2.5}, "provenance": {"time": when}})
    )
    return root


def test_runs_that_differ_only_in_provenance_and_timings_are_equal(tmp_path):
    a = make_results(tmp_path / "a", producer='{"time": "1"}', when="monday")
    b = make_results(tmp_path / "b", producer='{"time": "2"}', when="tuesday")
    text = (b / "train" / "metrics.jsonl").read_text().replace("0.1", "0.7")
    (b / "train" / "metrics.jsonl").write_text(text)
    checked, diffs = parity.compare(a, b)
    assert sorted(checked) == [
        "eval/eval.json",
        "hidden/shard_000.h5",
        "train/metrics.jsonl",
        "vocab/vocab.safetensors",
    ]
    assert diffs == []


def edit_hdf5(path: Path, dataset: str | None = None, attr: str | None = None) -> None:
    with h5py.File(path, "a") as f:
        if dataset:
            f[dataset][0, 0] = 9
        if attr:
            f.attrs[attr] = 5


def test_every_kind_of_output_change_is_named(tmp_path):
    a = make_results(tmp_path / "a", producer="x", when="t")
    for mutate, name in [
        (lambda b: (b / "vocab" / "vocab.safetensors").write_bytes(bytes(range(1, 65))), "vocab"),
        (lambda b: edit_hdf5(b / "hidden" / "shard_000.h5", dataset="aux_hidden"), "hidden"),
        (lambda b: edit_hdf5(b / "hidden" / "shard_000.h5", attr="hidden_size"), "hidden"),
        (
            lambda b: (b / "train" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.6}\n'),
            "train/metrics",
        ),
        (
            lambda b: (b / "eval" / "eval.json").write_text(
                '{"trained": {"acceptance_length": 3}}'
            ),
            "eval/eval",
        ),
        (lambda b: (b / "vocab" / "vocab.safetensors").unlink(), "vocab"),
    ]:
        b = tmp_path / "b"
        shutil.rmtree(b, ignore_errors=True)
        shutil.copytree(a, b)
        mutate(b)
        _, diffs = parity.compare(a, b)
        assert len(diffs) == 1 and diffs[0].startswith(name), diffs
    assert parity.main([str(a), str(a)]) == 0
    assert parity.main([str(a), str(b)]) == 1
