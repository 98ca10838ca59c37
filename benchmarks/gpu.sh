#!/usr/bin/env bash
# Every GPU measurement of BENCHMARKS.md in one go, on an NVIDIA machine (BENCHMARKS.md gives
# each part's time); where one command may run only so long, run the parts one by one.
#
#   bash benchmarks/gpu-wheels.sh                 # where pip reaches an index: fills .whl/
#   bash benchmarks/gpu.sh [extraction] [extraction_vllm] [read_path] [training]
#                          [workflow_rehearsal] [workflow_real]
#                                                 # on the GPU machine; default: the first four
#
# Installs .whl/*.whl (speculators 0.9.0 and what the image lacks) into a private folder when
# present, then runs each benchmark; each prints its table and writes
# benchmarks/results/<name>-<gpu>.json. With $OUT set (a folder to bring back from the GPU
# machine), the JSON files and the logs are copied there too. Training runs its two-GPU scaling
# cell when two GPUs are visible.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
  site=${TMPDIR:-/tmp}/eyrie-bench-site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
  # after the image's own packages: only what it lacks comes from here
  export PYTHONPATH=$PYTHONPATH:$site
fi
parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(extraction extraction_vllm read_path training)
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
[ "$gpus" -le 2 ] || gpus=2   # the scaling cell compares 2 GPUs with 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
logs=$(mktemp -d); touch "$logs/.start"
for part in "${parts[@]}"; do
  t0=$SECONDS; echo "== $part $(date +%T)"
  case $part in
    extraction) "$PY" benchmarks/extraction_gpu.py --models llama8b deepseek ;;
    # needs vLLM importable by $PY (the vLLM pack on PYTHONPATH: docs/rehearsal.md)
    extraction_vllm) "$PY" benchmarks/extraction_vllm.py --shapes llama8b kimi4 kimi4int4 kimideepint4 ;;
    read_path)  "$PY" benchmarks/read_path.py --gb 5 --repeats 3 ;;
    training)   "$PY" benchmarks/training_gpu.py --gpus "$gpus" ;;
    # the workflow through Snakemake (needs VLLM_SITE, an unpacked vLLM pack, and .whl/)
    workflow_rehearsal) bash benchmarks/workflow_gpu.sh rehearsal ;;
    workflow_real) bash benchmarks/workflow_gpu.sh real ;;
    *) echo "gpu.sh: unknown part '$part' (use extraction, extraction_vllm, read_path, training, workflow_rehearsal or workflow_real)" >&2
       exit 2 ;;
  esac 2>&1 | tee "$logs/$part.log"
  echo "== $part took $((SECONDS - t0)) s"
done
if [ -n "${OUT:-}" ]; then
  cp "$logs"/*.log "$OUT"/
  find benchmarks/results -name '*.json' -newer "$logs/.start" -exec cp {} "$OUT"/ \;
fi
