"""Rehearsal (`vllm.rehearsal: true`): the vLLM engines build the real target architecture with
random weights (vLLM's `load_format="dummy"`), so a runtime failure of a GPU stage shows in
minutes, before the real load is paid for (docs/rehearsal.md).

A rehearsal runs under the name `<target.name>.rehearsal` (its own results/, logs/ and store
keys), and every file it writes says so: `"rehearsal": true` in its JSON files, the attribute
`rehearsal` = 1 on its hidden-state shards. A real run's files carry no such key, so they are the
bytes they were. A real stage refuses a rehearsal's file with one line (`refusal`; raised by
`refuse_in_real_run` where a rehearsal of the stage is the other way). Imports only the standard
library: every environment reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

SUFFIX = ".rehearsal"  # results/<name>.rehearsal/, logs/<name>.rehearsal/
LOAD_FORMAT = "dummy"  # vLLM: build every layer, fill its weights with random values
# the speculative run's draft keeps its own weights (vLLM's SpeculativeConfig.draft_load_config)
DRAFT_LOAD_CONFIG = {"load_format": "auto"}
KEY = "rehearsal"  # the mark in a JSON file, the attribute of a shard
DOC = "docs/rehearsal.md"


def is_rehearsal(settings: dict) -> bool:
    """Whether a stage's --settings (or the config) ask for a rehearsal (vllm.rehearsal)."""
    vllm = settings.get("vllm")
    return isinstance(vllm, dict) and vllm.get(KEY) is True  # a bad section: the schema says so


def run_name(name: str, rehearsal: bool) -> str:
    """The folder name of a run: target.name, with SUFFIX for a rehearsal."""
    return name + SUFFIX if rehearsal else name


def mark(rehearsal: bool) -> dict:
    """What a rehearsal's JSON output adds to its top level (nothing for a real run)."""
    return {KEY: True} if rehearsal else {}


def marked(obj) -> bool:
    """Whether a JSON output (a dict read back) is a rehearsal's."""
    return isinstance(obj, dict) and obj.get(KEY) is True


def engine_kwargs(rehearsal: bool) -> dict:
    """What a rehearsal adds to the arguments of vllm.LLM: random weights, no weights read."""
    return {"load_format": LOAD_FORMAT} if rehearsal else {}


def draft_is_rehearsal(draft_dir: str | Path) -> bool:
    """Whether an exported draft folder is a rehearsal's (its provenance.json says so)."""
    path = Path(draft_dir) / "provenance.json"
    try:
        return marked(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError):
        return False  # no readable provenance: not a draft eyrie exported in a rehearsal


def refusal(path: str | Path, what: str, fix: str) -> str:
    """The one line a real stage says when given a rehearsal's file `path` (a `what`)."""
    return (
        f"{path}: {what} of a rehearsal (vllm.rehearsal: true: the target ran with random "
        f"weights), which a real run never uses; {fix} ({DOC})"
    )


def refuse_in_real_run(
    found: str | Path | None, what: str, use: str, folder: str, stage: str, error: type[Exception]
) -> None:
    """A real run given a rehearsal's file `found` (a `what`; None: none was) raises `error` with
    the refusal: `use` the file of the run without vllm.rehearsal (results/<name>/`folder`), or
    rehearse the `stage`."""
    if found is not None:
        fix = (
            f"{use} of the run without vllm.rehearsal (results/<name>/{folder}), or set "
            f"vllm.rehearsal: true to rehearse the {stage}"
        )
        raise error(refusal(found, what, fix))
