"""Workflow configuration: JSON-schema validation (all errors at once) and defaults."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

from eyrie.errors import ConfigError

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "config" / "schema.yaml"


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def _fill_defaults(schema: dict, node: Any) -> None:
    if not isinstance(node, dict):
        return
    for name, sub in schema.get("properties", {}).items():
        if name not in node and "default" in sub:
            node[name] = copy.deepcopy(sub["default"])
        if name not in node and sub.get("type") == "object":
            node[name] = {}
        if name in node:
            _fill_defaults(sub, node[name])


def validate_config(config: dict, schema_path: Path = SCHEMA_PATH) -> dict:
    """Validate `config` against the schema; return a copy with defaults filled.

    Raises ConfigError listing every problem, one per line, each naming its key.
    """
    schema = yaml.safe_load(Path(schema_path).read_text())
    config = copy.deepcopy(config)
    _fill_defaults(schema, config)
    validator = Draft202012Validator(schema)
    problems = []
    for err in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path))):
        if err.validator == "additionalProperties":
            extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
            for name in extra:
                allowed = ", ".join(sorted(err.schema.get("properties", {})))
                problems.append(
                    f"{_key([*err.absolute_path, name])}: unknown key (allowed here: {allowed})"
                )
        else:
            problems.append(f"{_key(err.absolute_path)}: {err.message}")
    if problems:
        raise ConfigError(
            f"invalid configuration ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  "
            + "\n  ".join(problems)
        )
    return config


def load_config(path: str | Path) -> dict:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return validate_config(raw)


def settings_json(section: dict) -> str:
    """Canonical JSON text of a config section: what rules pass as params."""
    return json.dumps(section, sort_keys=True, separators=(",", ":"))
