"""Configuration and stage settings, both checked against config/schema.yaml (docs/contracts.md).

`validate_config` checks the whole config; `load_settings` checks a stage's `--settings` (its
sections of the config, `trust_remote_code` at the top) against the same schema subtrees. Both
fill the schema's defaults and report every problem at once, each naming its dotted key; a stage
then checks only the cross-field rules a schema cannot express.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from eyrie.errors import ConfigError, EyrieError

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "config" / "schema.yaml"


# --settings name of a config key that stages receive outside its section
SETTINGS_ALIASES = {"target.trust_remote_code": "trust_remote_code"}


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


@functools.cache
def _schema(schema_path: Path) -> dict:
    return yaml.safe_load(Path(schema_path).read_text())


def schema(schema_path: Path = SCHEMA_PATH) -> dict:
    """The parsed schema (a fresh copy: callers may change it)."""
    return copy.deepcopy(_schema(Path(schema_path)))


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


def _problems(schema: dict, instance: Any, prefix: Sequence[str] = ()) -> list[str]:
    """Every schema violation of `instance`, one line each, named by its dotted key."""
    from jsonschema import Draft202012Validator  # imported when needed: `eyrie extract` stays light

    problems = []
    errors = Draft202012Validator(schema).iter_errors(instance)
    for err in sorted(errors, key=lambda e: list(map(str, e.absolute_path))):
        path = [*prefix, *err.absolute_path]
        if err.validator == "additionalProperties":
            allowed = sorted(err.schema.get("properties", {}))
            for name in sorted(set(err.instance) - set(allowed)):
                problems.append(
                    f"{_key([*path, name])}: unknown key (allowed here: {', '.join(allowed)})"
                )
        else:
            problems.append(f"{_key(path)}: {err.message}")
    return problems


def validate_config(config: dict, schema_path: Path = SCHEMA_PATH) -> dict:
    """Validate `config` against the schema; return a copy with defaults filled.

    Raises ConfigError listing every problem, one per line, each naming its key.
    """
    tree = schema(schema_path)
    config = copy.deepcopy(config)
    _fill_defaults(tree, config)
    problems = _problems(tree, config)
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


def key_schema(key: str, schema_path: Path = SCHEMA_PATH) -> dict:
    """The schema subtree of a dotted config key (`definitions` kept for its $refs)."""
    tree = schema(schema_path)
    node = tree
    for part in key.split("."):
        node = node["properties"][part]
    return {**node, "definitions": tree.get("definitions", {})}


def schema_default(key: str) -> Any:
    """The schema's default of a dotted config key (e.g. "extract.engine_wait_s")."""
    return key_schema(key)["default"]


def value_problems(key: str, value: Any, name: str | None = None) -> list[str]:
    """The schema's problems with one value of `key`, named `name` (a CLI flag) or the key."""
    return _problems(key_schema(key), value, [name or key])


def flag_problems(key: str, value: Any, flag: str) -> list[str]:
    """The schema's problems with a CLI flag that overrides `key` (none when it is not given)."""
    return [] if value is None else value_problems(key, value, flag)


def _settings_schema(schema_path: Path = SCHEMA_PATH) -> dict:
    """The schema of a --settings object: the config's sections, aliased keys at the top."""
    tree = schema(schema_path)
    props = {name: sub for name, sub in tree["properties"].items() if name != "target"}
    for key, alias in SETTINGS_ALIASES.items():
        props[alias] = key_schema(key, schema_path)
    return {
        "type": "object",
        "additionalProperties": False,
        "definitions": tree.get("definitions", {}),
        "properties": props,
    }


def load_settings(
    settings: dict,
    required: Sequence[str] = (),
    error: type[EyrieError] = ConfigError,
    also: Sequence[str] = (),
) -> dict:
    """A stage's --settings checked against the schema; a copy with the defaults filled in.

    Sections absent from `settings` stay absent (a stage decides which it needs: `required`);
    `also` are the caller's own problems, reported with the schema's in one `error`.
    """
    tree = _settings_schema()
    loaded = copy.deepcopy(settings)
    problems = list(also)
    problems += [
        f"{name}: missing; pass the config's {name} section"
        for name in required
        if name not in loaded
    ]
    for name, sub in tree["properties"].items():
        if name in loaded:
            _fill_defaults(sub, loaded[name])
        elif sub.get("type") != "object" and "default" in sub:
            loaded[name] = copy.deepcopy(sub["default"])
    problems += _problems(tree, loaded)
    if problems:
        raise error("invalid --settings: " + "; ".join(problems))
    return loaded


def settings_json(section: dict) -> str:
    """Canonical JSON text of a config section: what rules pass as params."""
    return json.dumps(section, sort_keys=True, separators=(",", ":"))


def vllm_uses(settings: dict) -> list[str]:
    """What vLLM is used for in this run: "extract" (extract.backend: vllm), "eval" (eval.vllm)."""
    out = []
    if (settings.get("extract") or {}).get("backend") == "vllm":
        out.append("extract")
    if (settings.get("eval") or {}).get("vllm") is True:
        out.append("eval")
    return out


def merge_settings(settings: dict, runtime: dict) -> dict:
    """settings with runtime's sections merged in (runtime keys win)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in settings.items()}
    for section, values in runtime.items():
        out[section] = (
            {**(out.get(section) or {}), **values} if isinstance(values, dict) else values
        )
    return out
