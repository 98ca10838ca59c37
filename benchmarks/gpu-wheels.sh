#!/usr/bin/env bash
# Fetch, here (where pip reaches an index), the wheels that benchmarks/gpu.sh installs on a GPU
# machine without network: speculators 0.9.0 (its trainer and data classes are the peers) and the
# packages it needs that a CUDA torch image (torch, transformers, h5py, pyarrow, ...) lacks.
# Writes .whl/ at the repository root (git-ignored; ~7 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  speculators==0.9.0 hs_connectors==0.9.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19
  loguru==0.7.3 openai==3.57.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2
  httpcore2==2.16.2 truststore==0.10.5 pydantic==2.14.4 pydantic_core==2.50.5
  pydantic_settings==2.16.3 python_dotenv==1.2.4 typing_inspection==0.4.5 annotated_types==0.8.0
  jsonschema==4.26.0 jsonschema_specifications==2025.9.1 referencing==0.37.0 rpds_py==2026.9.1
)
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
echo "gpu-wheels: $(ls .whl/*.whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1))"
