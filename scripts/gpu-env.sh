# Sourced by benchmarks/workflow_gpu.sh and scripts/gpu-tests.sh: eyrie installed (editable) into a
# virtual environment over a GPU image's packages, on a machine without network. Snakemake and
# what the image lacks come as wheels (.whl/, from benchmarks/gpu-wheels.sh), vLLM as an unpacked
# site folder ($VLLM_SITE; docs/rehearsal.md says how to pack one). Sets ENV (the environment;
# $EYRIE_GPU_ENV, default ${TMPDIR:-/tmp}/eyrie-gpu-env), whose bin/ holds the `eyrie` the rules
# call and `vllm-python`: the same Python with the vLLM site first (vLLM pins its own packages).
: "${VLLM_SITE:?set VLLM_SITE to an unpacked vLLM site folder}"
ENV=${EYRIE_GPU_ENV:-${TMPDIR:-/tmp}/eyrie-gpu-env}
if [ ! -x "$ENV/bin/eyrie" ]; then
  python3 -m venv --system-site-packages --without-pip "$ENV"
fi
site=$("$ENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -x "$ENV/bin/eyrie" ]; then
  # the image's own package folders, wherever its python3 finds them (PYTHONPATH, user site)
  python3 -c 'import sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))' \
    > "$site/image.pth"
  pip=(python3 -m pip --python "$ENV/bin/python" install -q --no-index --no-deps --no-compile)
  "${pip[@]}" .whl/*.whl
  "${pip[@]}" --no-build-isolation -e .
fi
# bytecode, as a pip install writes it (the pack and the wheels above are installed without):
# otherwise the first import of vLLM, speculators and Snakemake in each fresh folder compiles it
if [ ! -f "$ENV/.compiled" ]; then
  "$ENV/bin/python" -m compileall -q -j 0 "$VLLM_SITE" "$site" >/dev/null 2>&1 || true
  touch "$ENV/.compiled"
fi
cat > "$ENV/bin/vllm-python" <<WRAPPER
#!/usr/bin/env bash
export PYTHONPATH=$VLLM_SITE\${PYTHONPATH:+:\$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0
exec $ENV/bin/python "\$@"
WRAPPER
chmod +x "$ENV/bin/vllm-python"
export PYTHONUNBUFFERED=1
