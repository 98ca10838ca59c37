#!/usr/bin/env bash
# The workflow itself on one GPU, as users run it (`snakemake -c all`), on a machine without
# network, in the environment scripts/gpu-env.sh makes (wheels from .whl/, vLLM from the
# unpacked site folder $VLLM_SITE).
#
#   VLLM_SITE=/path/site bash benchmarks/workflow_gpu.sh rehearsal   # Kimi-K2.5-shaped int4, no weights
#   VLLM_SITE=/path/site bash benchmarks/workflow_gpu.sh real        # the larger demo target
#
# benchmarks/workflow_gpu.py runs the parts and writes benchmarks/results/workflow-<part>-<gpu>.json
# (each job's time, the GPU memory peak); with $OUT set, the JSON and the logs are copied there.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
"$ENV/bin/python" benchmarks/workflow_gpu.py "$@" --vllm-python "$ENV/bin/vllm-python"
