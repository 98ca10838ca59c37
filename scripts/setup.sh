#!/usr/bin/env bash
# Creates .venv with everything the workflow and its tests need (idempotent, offline-safe
# apart from PyPI). Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.eyrie-setup
# `snakemake --profile slurm-gpu` looks the profile up by name in the current folder (and
# ~/.config/snakemake), not in profiles/: link it at the repository root (git-ignored).
[ -e slurm-gpu ] || [ -L slurm-gpu ] || ln -s profiles/slurm-gpu slurm-gpu
want=$(cat envs/train.txt envs/train-nodeps.txt pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: .venv is up to date"
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel
# torch first and pinned: 2.13.0 resolves to the CPU wheel on machines that have it locally.
python -m pip install -q "torch==${EYRIE_TORCH_VERSION:-2.13.0}"
python -m pip install -q -r envs/train.txt
python -m pip install -q --no-deps -r envs/train-nodeps.txt
python -m pip install -q --no-deps --no-build-isolation -e .
python - <<'PY'
from importlib.metadata import version

import h5py, speculators.models.eagle3, torch, transformers  # noqa: F401  (imports must work)
import torch.utils.tensorboard  # noqa: F401  (train.report_to's default)
print("setup: " + ", ".join(f"{p} {version(p)}" for p in
                            ("torch", "transformers", "speculators", "snakemake", "h5py",
                             "tensorboard")))
PY
echo "$want" > "$stamp"
