"""The workflow's side of the settings: which rules compare each config key, which only read it.

`TABLE` has one row per key of config/schema.yaml. A rule's `params.settings` (Snakemake's rerun
trigger compares its text) holds exactly the keys that list it under `compared`; `read` keys reach
a rule in its command text only (changing them reruns nothing). A key added after runs recorded
their params (the schema's `added: true`) is left out of the params text while it holds its
schema default, so that adding it reruns nothing; the stage fills the same default. The rule
files build their params with `rule_settings`, and docs/contracts.md's table is
`python -m eyrie.config.rules --contracts`.
`prepare` does what the workflow needs before its rules run (the PATH, the engine placeholders).
Only the rule files and tests import this module.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from eyrie.config.schema import (
    SETTINGS_ALIASES,
    added_later,
    schema,
    schema_default,
    settings_json,
)
from eyrie.core.runtime import cache_environment, launch_environment
from eyrie.store.store import ENV as STORE_ENV

REPO = Path(__file__).resolve().parents[2]
CONTRACTS = REPO / "docs" / "contracts.md"


def _vllm_extract(config: dict) -> bool:
    return config["extract"]["backend"] == "vllm"


def _vllm_used(config: dict) -> bool:
    return _vllm_extract(config) or config["eval"]["vllm"]


def _vllm_regenerate(config: dict) -> bool:
    return config["regenerate"]["backend"] == "vllm"


# `rule?condition` in the table: the rule takes the key only when the condition holds
CONDITIONS = {
    "vllm_extract": (_vllm_extract, "with extract.backend: vllm"),
    "vllm": (_vllm_used, "when vLLM is used"),
    "vllm_regenerate": (_vllm_regenerate, "with regenerate.backend: vllm"),
}


@dataclass(frozen=True)
class Row:
    """One config key: the rules comparing it, the rules only reading it, other workflow uses."""

    key: str
    compared: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    other: str = ""


DEMO_TARGET = ("build_demo_target",)
DATA = ("tokenize_conversations",)
REGENERATE = ("regenerate_responses",)
VLLM_REGENERATE = ("regenerate_responses?vllm_regenerate",)
EXTRACT = ("extract_hidden_states",)
TRAIN = ("train_draft", "export_draft")
VLLM_EXTRACT = ("extract_hidden_states?vllm_extract",)
VLLM_READ = ("preflight?vllm",)
ENGINE_READ = ("extract_engine?vllm_extract",)

TABLE = (
    Row("target.name", other="the paths results/<name>/..., logs/<name>/..."),
    Row("target.path", other="the target folder (null: the demo target, built by the workflow)"),
    Row(
        "target.trust_remote_code",
        (
            "tokenize_conversations",
            "preflight",
            *EXTRACT,
            "preflight_regenerate",
            *REGENERATE,
            "tokenize_eval_prompts",
        ),
    ),
    Row("demo.seed", ("build_demo_conversations", *DEMO_TARGET)),
    Row("demo.num_conversations", ("build_demo_conversations",)),
    Row("demo.vocab_size", DEMO_TARGET),
    Row("demo.hidden_size", DEMO_TARGET),
    Row("demo.num_hidden_layers", DEMO_TARGET),
    Row("demo.num_attention_heads", DEMO_TARGET),
    Row("demo.num_key_value_heads", DEMO_TARGET),
    Row("demo.intermediate_size", DEMO_TARGET),
    Row("demo.train_steps", DEMO_TARGET),
    Row("demo.batch_size", DEMO_TARGET),
    Row("demo.seq_len", DEMO_TARGET),
    Row("demo.learning_rate", DEMO_TARGET),
    Row("demo.device", DEMO_TARGET, other="build_demo_target's gpu resource"),
    Row("data.conversations", DATA, other="the inputs of tokenize_conversations"),
    Row("data.max_seq_len", DATA),
    Row("data.num_shards", DATA, other="one extract_hidden_states job per shard"),
    Row("data.num_eval", DATA),
    Row("data.seed", DATA),
    Row("data.strict", DATA),
    Row("data.mask_mode", DATA),
    Row("data.train_reasoning", DATA),
    Row("data.non_text", (*DATA, *REGENERATE)),
    Row(
        "data.chat_template_kwargs",
        (*DATA, *REGENERATE, "tokenize_eval_prompts", "preflight", "preflight_regenerate"),
    ),
    Row("data.reasoning_parser", DATA),
    Row(
        "data.regenerate",
        DATA,
        other="true: regenerate_responses jobs, whose files tokenize_conversations reads",
    ),
    Row("regenerate.num_shards", REGENERATE, other="one regenerate_responses job per shard"),
    Row(
        "regenerate.backend",
        REGENERATE,
        ("preflight_regenerate?vllm_regenerate",),
        other="the job's environment and GPUs",
    ),
    Row("regenerate.device", REGENERATE, other="regenerate_responses's gpu resource"),
    *(
        Row(f"regenerate.{name}", REGENERATE)
        for name in (
            "max_new_tokens",
            "temperature",
            "top_p",
            "seed",
            "turns",
            "thinking",
            "batch_size",
        )
    ),
    Row("layers.aux_ids", ("preflight", *EXTRACT, "preflight_regenerate")),
    Row("vocab.draft_vocab_size", ("build_vocab_map",)),
    Row(
        "extract.backend",
        (*EXTRACT, "preflight?vllm_extract"),
        other="the engine's environment and GPUs",
    ),
    Row("extract.device", EXTRACT, other="extract_engine's gpu resource"),
    Row("extract.dtype", EXTRACT),
    Row("extract.storage_dtype", (*EXTRACT, "preflight")),
    Row("extract.max_tokens_per_batch", EXTRACT),
    Row("extract.group_size", other="the shards one extract_engine job serves"),
    Row("extract.engine_wait_s", read=EXTRACT),
    Row("train.seed", TRAIN),
    Row("train.device", TRAIN, other="train_draft's gpu resource"),
    *(
        Row(f"train.{name}", TRAIN)
        for name in (
            "epochs",
            "learning_rate",
            "weight_decay",
            "warmup_steps",
            "max_grad_norm",
            "max_tokens_per_batch",
            "packs_per_step",
            "ttt_steps",
            "ttt_step_loss_decay",
            "num_layers",
            "draft_arch",
            "precision",
            "pack_shape",
            "norm_before_residual",
            "checkpoint_every",
            "log_every",
            "verify_shards",
        )
    ),
    Row("train.report_to", ("train_draft",)),
    Row("train.fsdp", ("train_draft",)),
    *(
        Row(f"train.{name}", TRAIN)
        for name in (
            "loss",
            "lr_schedule",
            "hidden_noise",
            "norm_before_fc",
            "method",
            "block_size",
            "sample_from_anchor",
            "mask_token_id",
            "aux_ids",
        )
    ),
    # preflight sizes the evaluation's vLLM engine from them
    Row("eval.num_speculative_tokens", ("evaluate_draft", "evaluate_vllm"), VLLM_READ),
    Row("eval.max_new_tokens", ("evaluate_draft", "evaluate_vllm"), VLLM_READ),
    Row("eval.num_prompts", ("evaluate_draft", "evaluate_vllm")),
    Row("eval.device", ("evaluate_draft",), other="evaluate_draft's gpu resource"),
    Row("eval.dtype", ("evaluate_draft",)),
    Row("eval.temperature", ("evaluate_draft", "evaluate_vllm")),
    Row(
        "eval.prompts",
        other="an input of tokenize_eval_prompts, whose output is the eval set of evaluate_draft "
        "and evaluate_vllm (null: the held-out conversations' eval.parquet)",
    ),
    Row("eval.vllm", read=VLLM_READ, other="`all` asks for eval_vllm.json"),
    Row(
        "vllm.python",
        read=(
            *VLLM_READ,
            *ENGINE_READ,
            *VLLM_REGENERATE,
            "preflight_regenerate?vllm_regenerate",
        ),
        other="evaluate_vllm and compile_kernels compare it as params.python (another "
        "environment: another vLLM)",
    ),
    Row(
        "vllm.extraction_path",
        (*VLLM_EXTRACT, "preflight?vllm_extract"),
        VLLM_READ,
    ),
    Row(
        "vllm.tensor_parallel_size",
        (*VLLM_EXTRACT, "preflight?vllm_extract", "evaluate_vllm", *VLLM_REGENERATE),
        VLLM_READ,
        other="the GPUs of a vLLM engine (extract_engine, evaluate_vllm)",
    ),
    Row("vllm.gpu_memory_gib", read=VLLM_READ),
    Row(
        "vllm.gpu_memory_utilization",
        read=(*VLLM_READ, *ENGINE_READ, "evaluate_vllm", *VLLM_REGENERATE),
    ),
    Row("vllm.enforce_eager", (*VLLM_EXTRACT, "evaluate_vllm", *VLLM_REGENERATE)),
    Row("vllm.dtype", ("evaluate_vllm", *VLLM_REGENERATE)),
    Row("vllm.max_model_len", (*VLLM_EXTRACT, "evaluate_vllm", *VLLM_REGENERATE), VLLM_READ),
    Row(
        "vllm.max_num_batched_tokens",
        ("evaluate_vllm", *VLLM_REGENERATE),
        VLLM_READ,
        other="the extraction engine takes it from preflight.json's vllm.engine",
    ),
    Row(
        "vllm.rehearsal",
        (*EXTRACT, "preflight", *TRAIN, "evaluate_vllm"),
        other="true: the paths results/<name>.rehearsal/..., logs/<name>.rehearsal/...; `all` "
        "asks for draft.json and eval_vllm.json, from shard 000 alone (docs/rehearsal.md)",
    ),
    Row(
        "cache.path",
        other="the compilation and kernel caches of every job (eyrie.config.rules.prepare); "
        "changes no output",
    ),
    Row(
        "store.path",
        other="EYRIE_STORE of every job (eyrie.config.rules.prepare): where extraction and "
        "regeneration keep and find their outputs; changes no output",
    ),
)


def schema_keys() -> list[str]:
    """Every dotted key of config/schema.yaml (sections and their keys)."""
    return [
        f"{section}.{name}"
        for section, sub in schema()["properties"].items()
        for name in sub.get("properties", {})
    ]


def _takes(entries: tuple[str, ...], rule: str, config: dict) -> bool:
    for entry in entries:
        name, _, when = entry.partition("?")
        if name == rule and (not when or CONDITIONS[when][0](config)):
            return True
    return False


def _settings(config: dict, rule: str, column: str) -> dict:
    out: dict = {}
    for row in TABLE:
        if _takes(getattr(row, column), rule, config):
            section, name = row.key.split(".")
            value = config[section][name]
            if column == "compared" and added_later(row.key) and value == schema_default(row.key):
                continue
            if row.key in SETTINGS_ALIASES:
                out[SETTINGS_ALIASES[row.key]] = value
            else:
                out.setdefault(section, {})[name] = value
    return out


def rule_settings(config: dict, rule: str) -> dict:
    """The settings `rule` compares: its params.settings (and its stage's --settings)."""
    return _settings(config, rule, "compared")


def runtime_settings(config: dict, rule: str) -> dict:
    """The settings `rule` reads but does not compare (command text: no rerun when they change)."""
    return _settings(config, rule, "read")


def vllm_stage_runtime(config: dict, rule: str) -> dict:
    """runtime_settings of a rule whose command runs in the vLLM environment (extract_engine):
    without vllm.python, which its command runs in, not a setting its stage reads (a shard would
    record the interpreter's path)."""
    runtime = copy.deepcopy(runtime_settings(config, rule))
    vllm = runtime.get("vllm", {})
    vllm.pop("python", None)
    if "vllm" in runtime and not vllm:
        del runtime["vllm"]
    return runtime


def rule_keys(config: dict, rule: str) -> set[str]:
    """The dotted keys `rule` takes under `config`'s conditions, compared or read (an added key
    at its default included: the stage then fills the same default)."""
    return {
        row.key
        for row in TABLE
        if _takes(row.compared, rule, config) or _takes(row.read, rule, config)
    }


def settings_param(config: dict, rule: str) -> str:
    """params.settings of `rule`: the canonical JSON text of rule_settings."""
    return settings_json(rule_settings(config, rule))


# ----------------------------------------------------------------------------- parse-time setup


class ComparedAs(str):
    """A rule's param whose text (what the shell gets) differs from what Snakemake's params
    trigger compares (its repr(): `compared`): the target folder now, compared as the path the
    same content was first given as (eyrie.store.fingerprint.track_target's "given")."""

    def __new__(cls, text: str, compared: str):
        obj = super().__new__(cls, text)
        obj.compared = compared
        return obj

    def __repr__(self) -> str:
        return repr(self.compared)


def engine_sockets(results: str, shards: list[str], group_size: int) -> list[str]:
    """The engine socket of every group of shards (shard i is in group i // group_size)."""
    groups = sorted({int(s) // group_size for s in shards})
    return [f"{results}/hidden/engine_{g:03d}.sock" for g in groups]


def prepare(
    basedir: str,
    python: str,
    sockets: list[str],
    store: str | None = None,
    cache: str | None = None,
) -> None:
    """What the rules need before they run: the `eyrie` CLI of the Python running Snakemake and,
    under SLURM, scripts/slurm-shims (the SLURM plugin mistakes sacct's "CANCELLED by <uid>" for a
    running job) on the PATH; the output store's folder in EYRIE_STORE (store.path; every job
    parses the workflow again, so SLURM jobs get it too); the compilation caches' folders under
    cache.path (eyrie.core.runtime.CACHES; a variable the user set before Snakemake started wins,
    named in one line, one a library set since does not); an
    empty placeholder for each missing engine socket (a service output counts as missing, so the
    shard jobs take it as ancient() input: docs/extraction.md)."""
    path = os.path.dirname(python) + os.pathsep + os.environ.get("PATH", "")
    if shutil.which("sacct"):
        path = os.path.join(basedir, "scripts", "slurm-shims") + os.pathsep + path
    os.environ["PATH"] = path
    if store:
        os.environ[STORE_ENV] = os.path.abspath(store)
    else:
        os.environ.pop(STORE_ENV, None)
    kept, launched = [], launch_environment()
    for var, folder in (cache_environment(cache) if cache else {}).items():
        # the user's own setting wins; one an import of this process made (torch's) does not
        os.environ[var] = launched.get(var, folder)
        if os.environ[var] != folder:
            kept.append(f"{var}={os.environ[var]}")
    if kept:  # the job then writes that cache where the real run on another node may not look
        print(
            f"cache.path {cache}: kept from the environment, outside it: {', '.join(kept)} "
            "(unset them to keep every cache there; docs/rehearsal.md)",
            file=sys.stderr,
        )
    for socket in sockets:
        if not os.path.lexists(socket):
            os.makedirs(os.path.dirname(socket), exist_ok=True)
            open(socket, "w").close()


# ----------------------------------------------------------------------------- docs/contracts.md

BEGIN = "<!-- settings table: generated by `python -m eyrie.config.rules --contracts` -->"
END = "<!-- end of settings table -->"


def _cell(entries: tuple[str, ...]) -> str:
    out = []
    for entry in entries:
        name, _, when = entry.partition("?")
        out.append(f"`{name}`" + (f" ({CONDITIONS[when][1]})" if when else ""))
    return ", ".join(out)


def contracts_table() -> str:
    """The markdown table of TABLE, as docs/contracts.md holds it between BEGIN and END."""
    lines = [
        BEGIN,
        "| key | compared by (params.settings) | read by (command text) | also |",
        "|---|---|---|---|",
    ]
    for row in TABLE:
        lines.append(f"| `{row.key}` | {_cell(row.compared)} | {_cell(row.read)} | {row.other} |")
    return "\n".join([*lines, END])


def write_contracts(path: Path = CONTRACTS) -> None:
    text = path.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    path.write_text(pattern.sub(lambda _: contracts_table(), text))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m eyrie.config.rules")
    parser.add_argument(
        "--contracts", action="store_true", help="rewrite docs/contracts.md's table"
    )
    if parser.parse_args().contracts:
        write_contracts()
    else:
        print(contracts_table())
