# Paths and per-rule settings. Each rule's `params.settings` holds exactly the config sections
# that change its output (Snakemake's `params` rerun trigger compares their text).

import json

from eyrie.config import settings_json, validate_config

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


def settings(**sections):
    return settings_json(sections)
