"""Configuration and stage settings, both checked against config/schema.yaml (docs/contracts.md).

`validate_config` checks the whole config, with the cross-field rules that can be checked before
any job runs; `load_settings` checks a stage's `--settings` (its sections of the config,
`trust_remote_code` at the top) against the same schema subtrees. Both fill the schema's
defaults, run the same cross-field rules (`cross_field_problems`) and report every problem at
once, each naming its dotted key. `config_file` and `workflow_config` are the
Snakefile's: one line per problem on the terminal, no traceback (rules/common.smk).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from eyrie.config.drafts import draft_problems
from eyrie.core import rehearsal
from eyrie.core.errors import ConfigError, EyrieError

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


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
        if "propertyNames" in err.schema_path:  # a key refused by name (its fix says why)
            problems.append(f"{_key([*path, err.instance])}: {err.schema['fix']}")
        elif err.validator == "additionalProperties":
            allowed = sorted(err.schema.get("properties", {}))
            for name in sorted(set(err.instance) - set(allowed)):
                problems.append(
                    f"{_key([*path, name])}: unknown key (allowed here: {', '.join(allowed)})"
                )
        else:
            # a pattern's message is the regular expression: the schema's `fix` says it in words
            # likewise a oneOf's ("not valid under any of the given schemas") where a fix says why
            words = err.validator == "pattern" or (err.validator == "oneOf" and "fix" in err.schema)
            what = f"{err.instance!r} is not allowed" if words else err.message
            fix = f"; {err.schema['fix']}" if "fix" in err.schema else ""
            problems.append(f"{_key(path)}: {what}{fix}")
    return problems


def _ints(config: dict, *keys: str) -> list[int] | None:
    """The values of dotted `keys` when each is an integer (else the schema reports it)."""
    values = []
    for key in keys:
        node = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, int) or isinstance(node, bool):
            return None
        values.append(node)
    return values


def cross_field_problems(config: dict, given: set[str] | None = None) -> list[str]:
    """Rules between keys that would otherwise fail only in the job that reads them: run on the
    whole config when the workflow parses (`given` None), and by load_settings on a stage's
    --settings, each rule only where `given` (the sections the settings hold) has every section
    it reads, so that a stage refuses what the dry run refuses, in the same words."""

    def has(*names: str) -> bool:
        return given is None or set(names) <= given

    problems = []
    both = _ints(config, "train.max_tokens_per_batch", "train.ttt_steps") if has("train") else None
    if both and both[0] < 8 * both[1]:
        problems.append(
            f"train.max_tokens_per_batch: {both[0]} is too small for train.ttt_steps={both[1]}; "
            f"set it to at least {8 * both[1]} (8 per TTT step) or lower train.ttt_steps"
        )
    sections = [
        _section(config, n) if has(n) else None for n in ("train", "layers", "eval", "vllm")
    ]
    if sections[0] is not None:
        problems += draft_problems(*sections)
    problems += rehearsal_problems(config, has)
    return problems + (report_problems(config) if has("train") else [])


def _section(config: dict, name: str) -> dict:
    value = config.get(name)
    return value if isinstance(value, dict) else {}


def rehearsal_problems(config: dict, has=lambda *names: True) -> list[str]:
    """What a rehearsal cannot rehearse (docs/rehearsal.md), and the name it keeps for itself;
    `has(*sections)`: whether a rule's sections are there to check (cross_field_problems)."""
    name = _section(config, "target").get("name")
    if not rehearsal.is_rehearsal(config):
        if isinstance(name, str) and name.endswith(rehearsal.SUFFIX):
            return [
                f"target.name: {name!r} ends in {rehearsal.SUFFIX!r}, which names a rehearsal's "
                f"folders; choose a name without it ({rehearsal.DOC})"
            ]
        return []
    problems = []
    backend = _section(config, "extract").get("backend")
    if has("extract") and backend != "vllm":
        problems.append(
            f"vllm.rehearsal: true but extract.backend is {backend!r}: "
            "a rehearsal runs the vLLM engines on random weights, and the hf backend would load "
            f"the real ones; set extract.backend: vllm ({rehearsal.DOC})"
        )
    if has("data") and _section(config, "data").get("regenerate") is True:
        problems.append(
            "vllm.rehearsal: true with data.regenerate: true: a random-weight target's responses "
            "run to regenerate.max_new_tokens, so every record would be dropped as cut; set "
            f"data.regenerate: false for the rehearsal ({rehearsal.DOC})"
        )
    return problems


# train.report_to's backends: the module each imports, which its pip package of that name installs
REPORTERS = {"tensorboard": "tensorboard", "wandb": "wandb"}


def report_problems(settings: dict) -> list[str]:
    """A train.report_to backend whose package this Python lacks: refused when the config is
    read and again when training starts, before any step, rather than curves silently missing."""
    asked = _section(settings, "train").get("report_to")
    problems = []
    for name in asked if isinstance(asked, list) else []:
        module = REPORTERS.get(name)
        if module and importlib.util.find_spec(module) is None:
            problems.append(
                f"train.report_to: {name} is asked for but {sys.executable} cannot import "
                f"{module}; install it (`{sys.executable} -m pip install {module}`) or remove "
                f"{name} from train.report_to"
            )
    return problems


def config_warnings(config: dict) -> list[str]:
    """Legal settings that likely do not do what was meant, each naming its keys and the fix."""
    warnings = []
    lengths = _ints(config, "train.max_tokens_per_batch", "data.max_seq_len", "train.ttt_steps")
    if lengths:
        tokens, seq_len, ttt = lengths
        # a sample of T <= max_seq_len tokens trains T - 1 positions; a pack gives each sample at
        # most max_tokens_per_batch - (ttt_steps - 1) of them (eyrie.train.packing.pack)
        room = tokens - (ttt - 1)
        if room < seq_len - 1:
            warnings.append(
                f"train.max_tokens_per_batch={tokens} with data.max_seq_len={seq_len} and "
                f"train.ttt_steps={ttt}: training cuts every sample longer than {room + 1} "
                f"tokens to {room + 1}; set train.max_tokens_per_batch to at least "
                f"{seq_len + ttt - 2} or data.max_seq_len to at most {room + 1}"
            )
    prompts = _ints(config, "eval.num_prompts", "data.num_eval")
    held_out = not (config.get("eval") or {}).get("prompts")  # eval.prompts: a question file's
    if prompts and prompts[0] > prompts[1] and held_out:
        warnings.append(
            f"eval.num_prompts={prompts[0]} is more than data.num_eval={prompts[1]}: the "
            f"evaluation has at most {prompts[1]} prompts; raise data.num_eval or lower "
            "eval.num_prompts"
        )
    return warnings


def _checked(config: dict, schema_path: Path = SCHEMA_PATH) -> tuple[dict, list[str]]:
    """A copy of `config` with the defaults filled, and its problems ("<dotted key>: ...")."""
    tree = schema(schema_path)
    config = copy.deepcopy(config)
    _fill_defaults(tree, config)
    return config, _problems(tree, config) + cross_field_problems(config)


def validate_config(config: dict, schema_path: Path = SCHEMA_PATH) -> dict:
    """Validate `config` against the schema; return a copy with defaults filled.

    Raises ConfigError listing every problem, one per line, each naming its key.
    """
    config, problems = _checked(config, schema_path)
    if problems:
        raise ConfigError(
            f"invalid configuration ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  "
            + "\n  ".join(problems)
        )
    return config


def yaml_problem(path: str | Path, exc: yaml.YAMLError) -> str:
    """A YAML error as one line: file:line:column where the parser gave up, what and the fix."""
    mark, context = getattr(exc, "problem_mark", None), getattr(exc, "context", None)
    if mark is None:
        where, what = str(path), str(exc)
    else:
        where, what = f"{path}:{mark.line + 1}:{mark.column + 1}", str(exc.problem)
        if context:
            start = getattr(exc, "context_mark", None)
            since = f" from line {start.line + 1}, column {start.column + 1}" if start else ""
            what += f" ({context}{since})"
    return (
        f"{where}: not valid YAML: {' '.join(what.split())}; fix the syntax there (indent with "
        "spaces, never tabs; close every bracket and quote)"
    )


def read_config(path: str | Path) -> dict:
    """A YAML config file as a dict; ConfigError in one line if it is not valid YAML."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_problem(path, exc)) from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a mapping of config sections; see config/config.yaml")
    return raw


def load_config(path: str | Path) -> dict:
    return validate_config(read_config(path))


def _exit(lines: list[str]) -> None:
    """End the Snakefile's parse with `lines` and nothing else: Snakemake prints any exception
    from a Snakefile with traceback frames, but lets SystemExit through (exit status 1)."""
    for line in lines:
        print(line, file=sys.stderr)
    raise SystemExit(1)


def config_file(path: str | Path) -> str:
    """The Snakefile's `configfile:` path, checked first: Snakemake's own error for a file that
    is not YAML names neither the file nor the line. A missing file is Snakemake's to report."""
    if not Path(path).is_file():
        return str(path)
    try:
        read_config(path)
    except ConfigError as exc:
        _exit([f"eyrie config: error: {exc}"])
    return str(path)


def workflow_config(
    config: dict, files: Sequence[str | Path] = (), overrides: Sequence[str | Path] = ()
) -> dict:
    """validate_config for the Snakefile: every problem one line on the terminal, naming the
    config file that sets its key, then exit; every warning of config_warnings one line.
    `files` are all config files read (Snakemake's workflow.configfiles), `overrides` those
    given with --configfile, which win in their order. Returns the config, defaults filled."""
    config, problems = _checked(config)
    if problems:
        given = [str(Path(f).absolute()) for f in overrides]
        order = [str(f) for f in files if str(Path(f).absolute()) not in given] + given
        setters = [(f, _dotted_keys(f)) for f in order]
        lines = []
        for problem in problems:
            key = problem.split(":", 1)[0]
            where = next((f for f, keys in reversed(setters) if key in keys), None)
            where = where or (order[0] if order else "config")  # a key no file sets
            lines.append(f"eyrie config: error: {where}: {problem}")
        _exit(lines)
    for warning in config_warnings(config):
        print(f"eyrie config: warning: {warning}", file=sys.stderr)
    return config


def _dotted_keys(path: str | Path) -> set[str]:
    """Every dotted key a config file sets (sections too); none if it cannot be read."""
    try:
        raw = read_config(path)
    except (ConfigError, OSError):
        return set()
    keys, todo = set(), [((), raw)]
    while todo:
        prefix, node = todo.pop()
        for name, value in node.items():
            keys.add(_key([*prefix, name]))
            if isinstance(value, dict):
                todo.append(((*prefix, name), value))
    return keys


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


def added_later(key: str) -> bool:
    """Whether `key` came after finished runs recorded their params and run ids (the schema's
    `added: true`): at its default it is left out of both, so that adding it reruns nothing."""
    return bool(key_schema(key).get("added"))


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
    the cross-field rules run on the sections given (cross_field_problems: the dry run's words);
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
    given = {name for name, value in settings.items() if isinstance(value, dict)}
    problems += cross_field_problems(loaded, given)
    if problems:
        raise error("invalid --settings: " + "; ".join(problems))
    return loaded


def settings_json(section: dict) -> str:
    """Canonical JSON text of a config section: what rules pass as params."""
    return json.dumps(section, sort_keys=True, separators=(",", ":"))


def vllm_uses(settings: dict) -> list[str]:
    """What vLLM is used for in this run: "extract" (extract.backend: vllm), "eval" (eval.vllm,
    or a rehearsal, which always ends with the vLLM evaluation)."""
    out = []
    if (settings.get("extract") or {}).get("backend") == "vllm":
        out.append("extract")
    if (settings.get("eval") or {}).get("vllm") is True or rehearsal.is_rehearsal(settings):
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
