"""The CLI layer: thread counts never exceed the CPUs the process may use; --settings and
--runtime are the cli's, each declared once for every stage that takes it."""

import argparse
import importlib
import os

import pytest

from eyrie.cli import RUNTIME, STAGES, build_parser
from eyrie.core.runtime import usable_threads


def test_threads_are_capped_at_the_usable_cpus():
    cpus = len(os.sched_getaffinity(0))
    assert usable_threads(cpus + 62) == cpus  # e.g. a SLURM grant above the node's real cores
    assert usable_threads(1) == 1


def test_settings_is_declared_once_by_the_cli_after_the_stage_name():
    """Every stage but `store` takes --settings (parsed into a dict) after its name, as the rules
    pass it; only preflight may leave it out."""
    for stage, (module, _, settings_help) in STAGES.items():
        own = argparse.ArgumentParser()
        importlib.import_module(module).add_arguments(own)
        assert "--settings" not in own._option_string_actions, module  # the cli declares it
        sub = build_parser(stage)._subparsers._group_actions[0].choices[stage]
        action = sub._option_string_actions.get("--settings")
        assert (action is None) == (settings_help is None), stage
        if action is not None:
            assert action.required == (stage != "preflight"), stage
    argv = ["--threads", "2", "vocab", "--target", "t", "--shards", "s", "--out", "o"]
    args = build_parser("vocab").parse_args([*argv, "--settings", '{"vocab": {}}'])
    assert args.settings == {"vocab": {}} and args.threads == 2
    with pytest.raises(SystemExit):
        build_parser("vocab").parse_args([*argv, "--settings", "[1]"])
    args = build_parser("preflight").parse_args(["preflight", "--target", "t", "--out", "o"])
    assert args.settings == {}


def test_runtime_is_declared_once_by_the_cli_for_the_stages_that_take_it():
    """--runtime (what the workflow reads but does not compare) is parsed the same way for every
    stage that takes it: a JSON object into args.runtime, {} when left out."""
    assert set(RUNTIME) <= set(STAGES)
    for stage, (module, _, _) in STAGES.items():
        own = argparse.ArgumentParser()
        importlib.import_module(module).add_arguments(own)
        assert "--runtime" not in own._option_string_actions, module  # the cli declares it
        sub = build_parser(stage)._subparsers._group_actions[0].choices[stage]
        assert ("--runtime" in sub._option_string_actions) == (stage in RUNTIME), stage
    argv = ["preflight", "--target", "t", "--out", "o"]
    assert build_parser("preflight").parse_args(argv).runtime == {}
    args = build_parser("preflight").parse_args([*argv, "--runtime", '{"eval": {"vllm": true}}'])
    assert args.runtime == {"eval": {"vllm": True}}
    for bad in ("[1]", "{not json"):
        with pytest.raises(SystemExit):
            build_parser("preflight").parse_args([*argv, "--runtime", bad])
