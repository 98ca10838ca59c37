#!/usr/bin/env bash
# The workflow itself on one GPU, as users run it (`snakemake -c all`), on a machine without
# network: Snakemake and what the image lacks come as wheels (.whl/, from
# benchmarks/gpu-wheels.sh), vLLM as an unpacked site folder ($VLLM_SITE; docs/rehearsal.md says
# how to pack one). eyrie is installed (editable) into a virtual environment over the image's
# packages, whose bin/ holds the `eyrie` the rules call.
#
#   VLLM_SITE=/path/site bash benchmarks/workflow_gpu.sh rehearsal   # Kimi-K2.5-shaped int4, no weights
#   VLLM_SITE=/path/site bash benchmarks/workflow_gpu.sh real        # the larger demo target
#
# benchmarks/workflow_gpu.py runs the parts and writes benchmarks/results/workflow-<part>-<gpu>.json
# (each job's time, the GPU memory peak); with $OUT set, the JSON and the logs are copied there.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${VLLM_SITE:?set VLLM_SITE to an unpacked vLLM site folder}"
ENV=${EYRIE_GPU_ENV:-${TMPDIR:-/tmp}/eyrie-gpu-env}
if [ ! -x "$ENV/bin/eyrie" ]; then
  python3 -m venv --system-site-packages --without-pip "$ENV"
  # the image's own package folders, wherever its python3 finds them (PYTHONPATH, user site)
  site=$("$ENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  python3 -c 'import sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))' \
    > "$site/image.pth"
  pip=(python3 -m pip --python "$ENV/bin/python" install -q --no-index --no-deps --no-compile)
  "${pip[@]}" .whl/*.whl
  "${pip[@]}" --no-build-isolation -e .
fi
# vllm.python: the same environment with the vLLM site first (it pins its own packages)
cat > "$ENV/bin/vllm-python" <<EOF
#!/usr/bin/env bash
export PYTHONPATH=$VLLM_SITE\${PYTHONPATH:+:\$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0
exec $ENV/bin/python "\$@"
EOF
chmod +x "$ENV/bin/vllm-python"
export PYTHONUNBUFFERED=1
"$ENV/bin/python" benchmarks/workflow_gpu.py "$@" --vllm-python "$ENV/bin/vllm-python"
