#!/usr/bin/env bash
# Fetch, here (where pip reaches an index), the wheels that benchmarks/gpu.sh installs on a GPU
# machine without network: speculators 0.9.0 (its trainer and data classes are the peers) and the
# packages it needs that a CUDA torch image (torch, transformers, h5py, pyarrow, ...) lacks, and
# Snakemake with its own. Writes .whl/ at the repository root (git-ignored; ~30 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  speculators==0.9.0 hs_connectors==0.9.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19
  loguru==0.7.3 openai==3.57.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2
  httpcore2==2.16.2 truststore==0.10.5 pydantic==2.14.4 pydantic_core==2.50.5
  pydantic_settings==2.16.3 python_dotenv==1.2.4 typing_inspection==0.4.5 annotated_types==0.8.0
  jsonschema==4.26.0 jsonschema_specifications==2025.9.1 referencing==0.37.0 rpds_py==2026.9.1
)
# Snakemake 9.27.1 and what it needs beyond the image (the workflow on the GPU machine:
# benchmarks/workflow_gpu.sh); versions as envs/train.txt pins them
WHEELS+=(
  snakemake==9.27.1 snakemake-interface-common==1.23.0 snakemake-interface-executor-plugins==9.4.0
  snakemake-interface-logger-plugins==2.1.0 snakemake-interface-report-plugins==1.3.0
  snakemake-interface-scheduler-plugins==2.0.2 snakemake-interface-storage-plugins==4.4.1
  argparse_dataclass==2.0.0 conda_inject==1.3.2 configargparse==1.9.0 docutils==0.22.4
  dpath==2.2.0 gitpython==3.2.1 gitdb==4.0.12 smmap==5.0.3 humanfriendly==10.0 immutables==0.21
  nbformat==5.11.1 fastjsonschema==2.22.3 jupyter_core==5.9.1 traitlets==5.16.1
  platformdirs==4.14.8 pulp==3.3.2 smart_open==7.7.1 sqlmodel==0.0.37 sqlalchemy==2.0.58
  greenlet==3.5.6 tenacity==9.2.1 throttler==1.2.3 yte==1.9.4
)
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
# connection_pool has no wheel on PyPI: built here (pure Python)
"$PY" -m pip wheel -q --no-deps -w .whl connection_pool==0.0.3
echo "gpu-wheels: $(ls .whl/*.whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1))"
