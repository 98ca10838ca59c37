#!/usr/bin/env bash
# The GPU tests (`pytest -m gpu`) on a GPU machine without network, from a fresh checkout:
#
#   VLLM_SITE=/path/site bash scripts/gpu-tests.sh [PYTEST ARGS]    # default: every gpu test
#
# The environment is scripts/gpu-env.sh's (wheels from .whl/, vLLM from the unpacked site folder;
# docs/rehearsal.md says how to make both); .venv and .venv-vllm/bin/python, which the tests
# run, become links to it and to its vllm-python. An existing .venv or .venv-vllm that is not
# such a link is left alone and the script stops: run the tests with those instead.
set -euo pipefail
cd "$(dirname "$0")/.."
for link in .venv .venv-vllm; do
  if [ -e "$link" ] && [ ! -L "$link" ] && [ ! -f "$link/.eyrie-gpu-links" ]; then
    echo "gpu-tests: $link exists and is not this script's; run .venv/bin/python -m pytest -m gpu there" >&2
    exit 2
  fi
done
source scripts/gpu-env.sh
ln -sfn "$ENV" .venv
mkdir -p .venv-vllm/bin && touch .venv-vllm/.eyrie-gpu-links
ln -sf "$ENV/bin/vllm-python" .venv-vllm/bin/python
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
exec .venv/bin/python -m pytest -m gpu -p no:cacheprovider --durations=0 "${@:-tests}"
