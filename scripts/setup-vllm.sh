#!/usr/bin/env bash
# Creates .venv-vllm: vLLM (which pins its own torch) plus what eyrie's vLLM stages import, and
# eyrie itself. Idempotent. About 9 GB from PyPI (README.md gives the time).
# On a CPU-only machine vLLM imports (preflight introspects it) but cannot run a model.
# Usage: bash scripts/setup-vllm.sh     (EYRIE_VLLM_VENV=DIR to put it elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${EYRIE_VLLM_VENV:-.venv-vllm}
stamp=$VENV/.eyrie-setup
want=$(cat envs/vllm.txt pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup-vllm: $VENV is up to date"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip "setuptools<82" wheel
"$VENV/bin/python" -m pip install -q -r envs/vllm.txt
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version

import vllm  # noqa: F401  (must import, even without a GPU)
print("setup-vllm: " + ", ".join(f"{p} {version(p)}" for p in ("vllm", "torch", "transformers")))
PY
echo "$want" > "$stamp"
