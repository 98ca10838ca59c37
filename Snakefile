# eyrie: EAGLE-3 draft training, from chat conversations to a draft that `vllm serve` loads.
# This file only wires things together: rules live in rules/*.smk, logic in the eyrie package.

import os
import shutil
import sys

# Rules call the `eyrie` CLI of the environment that runs Snakemake (.venv after setup).
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# On SLURM: the SLURM plugin polls sacct, which reports a cancelled job as "CANCELLED by <uid>";
# the plugin 2.8 does not recognise that and waits forever (scripts/slurm-shims/sacct says more).
if shutil.which("sacct"):
    os.environ["PATH"] = os.path.join(workflow.basedir, "scripts", "slurm-shims") + os.pathsep + os.environ["PATH"]


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
        # evaluation through vLLM itself: needs a GPU and .venv-vllm (docs/vllm.md)
        [f"{RESULTS}/eval/eval_vllm.json"] if config["eval"]["vllm"] else [],
    default_target: True
