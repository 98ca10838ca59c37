"""How tests call eyrie's stages: an argv built from the stage's options (as the rules spell
them), the stage run in this process through the CLI's own parser, and `python -m eyrie.cli` in a
subprocess (the demo conversations the workflow tests start from)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

from eyrie import cli

# The demo conversations of the workflow tests (`eyrie demo-conversations --settings ...`).
DEMO = {"demo": {"seed": 7, "num_conversations": 60}}


def options(**values) -> list[str]:
    """`--name value` for each keyword in order (`out_dir` is `--out-dir`): a list or tuple
    spreads its items after the flag, a dict is JSON (a stage's --settings), True is the flag
    alone, None leaves it out."""
    argv: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def stage_args(stage: str, **values) -> list[str]:
    """`STAGE --name value ...`, the argv of eyrie.cli.main."""
    return [stage, *options(**values)]


def eyrie_cmd(stage: str, **values) -> list[str]:
    """`python -m eyrie.cli STAGE --name value ...` in this environment."""
    return [sys.executable, "-m", "eyrie.cli", *stage_args(stage, **values)]


def run_stage(stage: str, *argv: str) -> int:
    """`eyrie STAGE ARGV` parsed by the CLI's own parser and run by the stage in this process;
    unlike eyrie.cli.main, an error reaches the test as the exception the stage raised."""
    args = cli.build_parser(stage).parse_args([stage, *argv])
    return importlib.import_module(args._module).run(args)


def demo_conversations(out: Path, settings: dict = DEMO, **run) -> subprocess.CompletedProcess:
    """`eyrie demo-conversations --out OUT` in a subprocess (the 60 of seed 7 by default);
    `run`: subprocess.run's keywords."""
    cmd = eyrie_cmd("demo-conversations", out=out, settings=settings)
    return subprocess.run(cmd, capture_output=True, text=True, **run)
