# The validated config, the paths every rule uses, and the helpers that build params from
# eyrie.config.rules's settings table (docs/contracts.md).

import json
import os
import shlex
import sys

from eyrie.core.errors import TargetError
from eyrie.core.rehearsal import run_name
from eyrie.chat.keywords import folder_templates, keyword_problems
from eyrie.config.drafts import draft_methods
from eyrie.config.schema import config_file, settings_json, workflow_config
from eyrie.store.fingerprint import demo_weights_changed, track_target
from eyrie.config.rules import (
    ComparedAs,
    engine_sockets,
    prepare,
    runtime_settings,
    settings_param,
    vllm_stage_runtime,
)


configfile: config_file(os.path.join(workflow.basedir, "config", "config.yaml"))


# every problem one line on the terminal, naming its file and key, then exit; warnings one line
config = workflow_config(config, workflow.configfiles, workflow.overwrite_configfiles)

# train.method may list kinds: the first is the run's draft (its rules, paths and settings text
# as with one kind: listing more reruns none of its jobs); each other one is trained, exported and
# evaluated from the same shards in methods/<method>/, and compare/ sets them side by side.
METHODS = draft_methods(config["train"]["method"])
config["train"]["method"] = METHODS[0]
ALSO = METHODS[1:]


wildcard_constraints:
    name=r"[^/]+",
    method="|".join(ALSO) or "-",


# A rehearsal (vllm.rehearsal: true: the vLLM engines on random weights) runs under its own name,
# <target.name>.rehearsal: its outputs, logs and store keys apart from the real run's.
REHEARSAL = config["vllm"]["rehearsal"]
NAME = run_name(config["target"]["name"], REHEARSAL)
RESULTS = f"results/{NAME}"
LOGS = f"logs/{NAME}"
BENCH = f"{RESULTS}/benchmarks"
DEMO = config["target"]["path"] is None
TARGET = f"{RESULTS}/target" if DEMO else config["target"]["path"]
# Files that stand for the target folder in the DAG. The demo target is an output of the
# workflow. A user's target is described at every parse by two fingerprint files, rewritten
# only when the config, weights or code (weights.json) or the tokenizer files (tokenizer.json)
# changed: a rule reruns exactly when what it reads of the target did (eyrie.store.fingerprint).
if DEMO:
    TARGET_WEIGHTS = TARGET_TOKENIZER = [
        f"{TARGET}/config.json",
        f"{TARGET}/tokenizer_config.json",
    ]
    _changed = demo_weights_changed(TARGET)
    if _changed:
        print(f"eyrie config: warning: {_changed}", file=sys.stderr)
else:
    try:
        _tracked = track_target(TARGET, f"{RESULTS}/fingerprint")
    except TargetError as exc:  # one line, no traceback frames (Snakemake lets SystemExit out)
        sys.exit(f"eyrie config: error: {exc}")
    TARGET_WEIGHTS, TARGET_TOKENIZER = [_tracked["weights"]], [_tracked["tokenizer"]]
    # a template switch the template never reads (a misspelt enable_thinking) renders every
    # record without it, in silence: one line now (the demo target's: at tokenization)
    for _problem in keyword_problems(
        config["data"]["chat_template_kwargs"] or {}, *folder_templates(TARGET)
    ):
        sys.exit(f"eyrie config: error: {_problem}")
TARGET_FILES = list(dict.fromkeys(TARGET_WEIGHTS + TARGET_TOKENIZER))  # the whole target
CONVERSATIONS = config["data"]["conversations"] or (
    [f"resources/{NAME}/conversations.jsonl"] if DEMO else []
)
if not CONVERSATIONS:
    sys.exit(
        "eyrie config: error: data.conversations: empty; list your conversation files "
        "(.jsonl/.json/.parquet)"
    )
# Every input path, at each parse: Snakemake runs no job whose outputs exist, so a misspelt path
# in a finished run would pass silently (and a setting changed with it would train on old data).
_given = [("data.conversations", p) for p in config["data"]["conversations"]]
_given += [("eval.prompts", config["eval"]["prompts"])] if config["eval"]["prompts"] else []
for _key, _path in _given:
    if not os.path.exists(_path):
        sys.exit(
            f"eyrie config: error: {_key}: {_path} not found (from {os.getcwd()}); fix the "
            "path, or give it relative to the working directory (snakemake -d)"
        )
# The store's and the caches' folders: a file there (a typo, a path reused) made every job
# log a warning and keep nothing; one line now
for _key in ("store.path", "cache.path"):
    _section, _name = _key.split(".")
    _folder = config[_section][_name]
    if _folder and os.path.exists(_folder) and not os.path.isdir(_folder):
        sys.exit(
            f"eyrie config: error: {_key}: {_folder} is a file, not a folder; name a folder "
            "(made when missing), or null to keep nothing"
        )
# The draft draft.json names, deleted by hand: Snakemake sees draft.json and plans nothing.
_manifest = f"{RESULTS}/draft.json"
if os.path.isfile(_manifest):
    try:
        with open(_manifest) as _f:
            _version = json.load(_f).get("version")
    except (OSError, ValueError, AttributeError):
        _version = None  # export_draft's own readers name an unreadable manifest
    if isinstance(_version, str) and not os.path.isdir(_version):
        print(
            f"eyrie config: warning: {_manifest} names the draft {_version}, which is gone; "
            "export it again with snakemake --forcerun export_draft",
            file=sys.stderr,
        )
SHARDS = [f"{i:03d}" for i in range(config["data"]["num_shards"])]
# The shards training reads: a rehearsal extracts and trains on shard 000 alone (one engine).
TRAIN_SHARDS = SHARDS[:1] if REHEARSAL else SHARDS
TRUST = config["target"]["trust_remote_code"]
GROUP_SIZE = config["extract"]["group_size"]
VLLM_EXTRACT = config["extract"]["backend"] == "vllm"
# The evaluation through vLLM: asked for, or the last stage of a rehearsal.
VLLM_EVAL = config["eval"]["vllm"] or REHEARSAL
# GPUs of one vLLM engine (extraction with the vllm backend, evaluation through vLLM).
VLLM_GPUS = config["vllm"]["tensor_parallel_size"]
VLLM_PYTHON = os.path.join(workflow.basedir, config["vllm"]["python"])
# Paths that reach a shell command from the config: quoted (a space must not split them).
VLLM_PYTHON_ARG = shlex.quote(VLLM_PYTHON)
TARGET_ARG = shlex.quote(TARGET)
# The rules' params.target: the folder now for the shell, compared as the path its content was
# first given as, so a symlink or a copy of the same folder reruns nothing.
TARGET_PARAM = TARGET_ARG if DEMO else ComparedAs(TARGET_ARG, shlex.quote(_tracked["given"]))

# The rules' `eyrie` on the PATH and the engine socket placeholders (eyrie.config.rules.prepare).
prepare(
    workflow.basedir,
    sys.executable,
    engine_sockets(RESULTS, SHARDS, GROUP_SIZE),
    config["store"]["path"],
    config["cache"]["path"],
)


def _all_cores() -> int:
    """`threads` of the heavy rules: locally every core given with -c; under a cluster profile
    (no --cores) 1 unless the profile's set-threads says otherwise (profiles/slurm-gpu)."""
    from snakemake.exceptions import WorkflowError

    try:
        return workflow.cores
    except WorkflowError:
        return 1


CORES = _all_cores()


def settings(rule_name: str) -> str:
    """params.settings of a rule: the config keys the settings table says it compares."""
    return settings_param(config, rule_name)


def also_settings(rule_name: str):
    """params.settings of `rule_name` for a kind listed after the first (the method wildcard)."""

    def of(wildcards) -> str:
        train = {**config["train"], "method": wildcards.method}
        return settings_param({**config, "train": train}, rule_name)

    return of


def also_dir(folder: str):
    """A folder of a kind listed after the first: results/<name>/methods/<method>/<folder>."""

    def of(wildcards) -> str:
        return f"results/{wildcards.name}/methods/{wildcards.method}/{folder}"

    return of


def gpus(device: str, count: int = 1) -> int:
    """GPUs a rule asks the cluster for (the `gpu` resource, sbatch --gpus under the slurm-gpu
    profile): none when its stage is set to run on the CPU. Local runs ignore it."""
    return 0 if device == "cpu" else count


# Folders passed to the stages. Functions of the wildcards only: Snakemake still compares their
# values (a function of input or output would leave the params trigger), as for the plain strings.
def target_dir(wildcards) -> str:
    """The target folder, quoted for the shell (its files stand for it in the inputs)."""
    return TARGET_PARAM


def tokenized_dir(wildcards) -> str:
    return f"results/{wildcards.name}/tokenized"


def demo_target_dir(wildcards) -> str:
    return f"results/{wildcards.name}/target"


def train_dir(wildcards) -> str:
    return f"results/{wildcards.name}/train"


def draft_dir(wildcards) -> str:
    """The link to the newest good draft version (its manifest, draft.json, is the output)."""
    return f"results/{wildcards.name}/draft"


def engine_socket(wildcards):
    """The socket of the engine serving this shard's group (ancient: its mtime never matters)."""
    group = int(wildcards.shard) // GROUP_SIZE
    return ancient(f"results/{wildcards.name}/hidden/engine_{group:03d}.sock")


def engine_log(wildcards, input):
    """The engine's log, named in the shard's errors (derived from the input: not compared)."""
    group = os.path.basename(input.engine)[len("engine_") : -len(".sock")]
    return f"logs/{wildcards.name}/extract_engine/engine_{group}.log"
