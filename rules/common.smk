# Paths and per-rule settings. Each rule's `params.settings` holds exactly the config sections
# that change its output (Snakemake's `params` rerun trigger compares their text).

import json

from eyrie.settings import settings_json, validate_config

config = validate_config(config)  # all schema errors at once, each naming its key

NAME = config["target"]["name"]
RESULTS = f"results/{NAME}"
LOGS = f"logs/{NAME}"
BENCH = f"{RESULTS}/benchmarks"
DEMO = config["target"]["path"] is None
TARGET = f"{RESULTS}/target" if DEMO else config["target"]["path"]
# Files that stand for the target folder in the DAG (weights may be sharded in user targets).
TARGET_FILES = [f"{TARGET}/config.json", f"{TARGET}/tokenizer_config.json"]
CONVERSATIONS = config["data"]["conversations"] or (
    [f"resources/{NAME}/conversations.jsonl"] if DEMO else []
)
if not CONVERSATIONS:
    raise ValueError("data.conversations: empty; list your conversation files (.jsonl/.json/.parquet)")
SHARDS = [f"{i:03d}" for i in range(config["data"]["num_shards"])]
TRUST = config["target"]["trust_remote_code"]


def _all_cores() -> int:
    """`threads` of the heavy rules: locally every core given with -c; under a cluster profile
    (no --cores) 1 unless the profile's set-threads says otherwise (profiles/slurm-gpu)."""
    from snakemake.exceptions import WorkflowError

    try:
        return workflow.cores
    except WorkflowError:
        return 1


CORES = _all_cores()


def settings(**sections):
    return settings_json(sections)


def gpus(device: str, count: int = 1) -> int:
    """GPUs a rule asks the cluster for (the `gpu` resource, sbatch --gpus under the slurm-gpu
    profile): none when its stage is set to run on the CPU. Local runs ignore it."""
    return 0 if device == "cpu" else count


# GPUs of one vLLM engine (extraction with the vllm backend, evaluation through vLLM).
VLLM_GPUS = config["vllm"]["tensor_parallel_size"]
