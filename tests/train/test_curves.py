"""Training curves: TensorBoard event files read back equal metrics.jsonl, once per step after a
crash and a resume; W&B through a stand-in module (no network); a backend that cannot be imported
is refused in one line naming train.report_to."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eyrie.config.schema import load_config, validate_config
from eyrie.config.sections import TrainSettings
from eyrie.core.errors import ConfigError, EyrieError
from eyrie.train.recipe import train
from tests.support import REPO
from tests.support.train_helpers import build_world, train_paths, train_settings

REPO_CONFIG = REPO / "config" / "config.yaml"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("world"), num_conversations=12)


def run_train(world, root, settings, **kw):
    paths = train_paths(world, root)
    return train(paths, settings, **kw)


def event_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard shows them (later attempts purge earlier ones)."""
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected_scalars(records: list[dict], log_every: int) -> dict[str, list[tuple[int, float]]]:
    """What the curves should hold, worked out from metrics.jsonl alone."""
    out: dict[str, list[tuple[int, float]]] = {}
    last = records[-1]["step"]
    tokens = mark_tokens = 0
    mark_wall = 0.0
    for r in records:
        s = r["step"]
        out.setdefault("train/loss", []).append((s, r["loss"]))
        out.setdefault("train/lr", []).append((s, r["lr"]))
        out.setdefault("train/grad_norm", []).append((s, r["grad_norm"]))
        for k in range(3):
            out.setdefault(f"accuracy/ttt_step_{k}", []).append((s, r[f"full_acc_{k}"]))
        tokens += r["tokens"]
        if s % log_every == 0 or s == last:
            rate = (tokens - mark_tokens) / (r["wall_s"] - mark_wall)
            out.setdefault("train/tokens_per_s", []).append((s, rate))
            mark_tokens, mark_wall = tokens, r["wall_s"]
    return out


def assert_curves_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for tag in want:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in want[tag]], rel=1e-5), tag


class Crash(Exception):
    pass


def crash_at(step):
    def on_step(s):
        if s == step:
            raise Crash

    return on_step


def stand_in_wandb(monkeypatch) -> list[dict]:
    """A `wandb` module that records init/log/finish (the runs it made, in order)."""
    runs: list[dict] = []

    def init(**kwargs):
        run = {"init": kwargs, "log": [], "finished": False}
        runs.append(run)
        return types.SimpleNamespace(
            log=lambda values, step: run["log"].append((step, dict(values))),
            finish=lambda: run.update(finished=True),
        )

    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def test_event_files_equal_metrics_once_per_step_after_a_crash_and_resume(
    world, tmp_path, monkeypatch
):
    runs = stand_in_wandb(monkeypatch)
    log_every = 3
    settings = train_settings(
        epochs=2, checkpoint_every=4, log_every=log_every, report_to=["tensorboard", "wandb"]
    )
    # records of steps 1-6 written, the checkpoint at step 4: steps 5 and 6 are trained again
    with pytest.raises(Crash):
        run_train(world, tmp_path, settings, on_step=crash_at(6))
    summary = run_train(world, tmp_path, settings)
    assert summary["resumed_from_step"] == 4

    records = [json.loads(ln) for ln in (tmp_path / "train" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, summary["steps"] + 1))
    want = expected_scalars(records, log_every)
    run_dir = tmp_path / "state" / summary["run_id"]
    # the run folder's files (two attempts) and the output folder's (written once at the end)
    assert_curves_equal(event_scalars(run_dir / "tensorboard"), want)
    assert_curves_equal(event_scalars(tmp_path / "train" / "tensorboard"), want)
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2

    # W&B: the resumed process continues the first one's run, from step 5
    first, second = runs
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert first["init"]["id"] == second["init"]["id"] == run_id
    assert second["init"]["resume"] == "allow" and first["finished"] and second["finished"]
    assert [s for s, _ in first["log"]] == list(range(1, 7))
    assert [s for s, _ in second["log"]] == list(range(5, summary["steps"] + 1))
    logged = {s: v for s, v in first["log"] + second["log"]}  # the resumed values win
    assert [logged[r["step"]]["train/loss"] for r in records] == [r["loss"] for r in records]
    assert {s: v["train/tokens_per_s"] for s, v in logged.items() if "train/tokens_per_s" in v}
    assert logged[3]["accuracy/ttt_step_2"] == records[2]["full_acc_2"]


def test_report_to_turned_on_after_a_run_writes_its_whole_curves(world, tmp_path, monkeypatch):
    summary = run_train(world, tmp_path, train_settings(epochs=1, report_to=[]))
    run_dir = tmp_path / "state" / summary["run_id"]
    assert not (tmp_path / "train" / "tensorboard").exists()
    assert not (run_dir / "tensorboard").exists() and not (run_dir / "wandb_run_id").exists()

    # the same run (report_to is not in the run id): resumed at its last step, no step trained
    runs = stand_in_wandb(monkeypatch)
    again = run_train(world, tmp_path, train_settings(epochs=1, report_to=["tensorboard", "wandb"]))
    assert again["run_id"] == summary["run_id"]
    assert again["resumed_from_step"] == again["steps"] == summary["steps"]
    records = [json.loads(ln) for ln in (tmp_path / "train" / "metrics.jsonl").open()]
    want = expected_scalars(records, log_every=5)
    assert_curves_equal(event_scalars(run_dir / "tensorboard"), want)
    assert_curves_equal(event_scalars(tmp_path / "train" / "tensorboard"), want)
    (run,) = runs
    assert [s for s, _ in run["log"]] == [r["step"] for r in records]


def test_a_backend_that_cannot_be_imported_is_refused_naming_the_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, installed or not
    fix = (
        f"train.report_to: wandb is asked for but {sys.executable} cannot import wandb; install "
        f"it (`{sys.executable} -m pip install wandb`) or remove wandb from train.report_to"
    )
    with pytest.raises(EyrieError) as launch:
        TrainSettings.from_settings(train_settings(report_to=["tensorboard", "wandb"]))
    assert str(launch.value) == f"invalid --settings: {fix}"
    config = load_config(REPO_CONFIG)
    config["train"]["report_to"] = ["wandb"]
    with pytest.raises(ConfigError) as parse:
        validate_config(config)
    assert str(parse.value).splitlines()[1:] == [f"  {fix}"]
    # the default asks for tensorboard only, which the project installs
    assert TrainSettings.from_settings(train_settings()).report_to == ("tensorboard",)
