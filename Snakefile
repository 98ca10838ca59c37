# eyrie: EAGLE-3 draft training, from chat conversations to a draft that `vllm serve` loads.
# This file only wires things together: rules live in rules/*.smk, logic in the eyrie package.

import os
import sys

# Rules call the `eyrie` CLI of the environment that runs Snakemake (.venv after setup).
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


configfile: os.path.join(workflow.basedir, "config", "config.yaml")


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/data.smk"
include: "rules/preflight.smk"
include: "rules/extract.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"


rule all:
    input:
        f"{RESULTS}/draft/config.json",
        f"{RESULTS}/eval/eval.json",
        f"{RESULTS}/eval/eval.png",
    default_target: True
