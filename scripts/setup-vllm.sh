#!/usr/bin/env bash
# Creates a vLLM environment: vLLM (which pins its own torch) plus what eyrie's vLLM stages import,
# and eyrie itself. Idempotent. About 9 GB each from PyPI (README.md gives the time); files that
# two environments share (most of torch and its CUDA libraries) become one hard link after each
# install (util-linux's hardlink, where installed), so all four take ~18 GB instead of ~36: a
# CI machine once ran out of disk building them. pip replaces a file rather than writing into
# it, so an upgrade in one environment leaves the others as they were.
# Before pip installs, every package the new environment needs at a version an environment already
# built here holds is hard-linked in (scripts/seed_venv.py reads pip's dry-run report), so the disk
# never holds a second copy, even for a moment: CI ran out of disk building 0.33 and 0.34 beside
# 0.22 and 0.26. pip compiles no bytecode (--no-compile; Python writes it for what a process
# imports: 1.4 GB less for all four). A build that stops on a full disk says so in one line with
# the folder, the free space and the fix, not only pip's Errno 28.
# On a CPU-only machine vLLM imports (preflight introspects it) but cannot run a model.
#   bash scripts/setup-vllm.sh          the default, envs/vllm.txt -> .venv-vllm (vllm.python)
#   bash scripts/setup-vllm.sh 0.33     envs/vllm-0.33.txt -> .venv-vllm-0.33
# A "# no-deps: SPEC" line in a requirements file installs SPEC without its dependencies first
# (vLLM 0.34 pins a flashinfer the registry lacks: envs/vllm-0.34.txt lists the rest).
#   bash scripts/setup-vllm.sh all      every envs/vllm*.txt (CI: the suite reads each version)
# EYRIE_VLLM_VENV=DIR puts a single environment elsewhere. Versions and how each is tested:
# docs/vllm.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

one() {  # one() REQUIREMENTS VENV
  local req=$1 venv=$2 stamp want
  stamp=$venv/.eyrie-setup
  want=$(cat "$req" pyproject.toml | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "setup-vllm: $venv is up to date"
    return 0
  fi
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --no-compile --upgrade pip "setuptools<82" wheel || full "$venv"
  # a "# no-deps: SPEC" line: SPEC without its dependencies, first (a pin the registry lacks)
  local nodeps
  nodeps=$(sed -n 's/^# no-deps: //p' "$req")
  [ -z "$nodeps" ] || seed "$venv" --no-deps $nodeps
  [ -z "$nodeps" ] || "$venv/bin/python" -m pip install -q --no-compile --no-deps $nodeps || full "$venv"
  seed "$venv" -r "$req"
  "$venv/bin/python" -m pip install -q --no-compile -r "$req" || full "$venv"
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
  "$venv/bin/python" - "$venv" <<'PY'
import sys
from importlib.metadata import version

import vllm  # noqa: F401  (must import, even without a GPU)
print(f"setup-vllm: {sys.argv[1]}: "
      + ", ".join(f"{p} {version(p)}" for p in ("vllm", "torch", "transformers")))
PY
  echo "$want" > "$stamp"
  share "$venv"
}

seed() {  # seed() VENV PIP-ARGS...: link in what the built environments already hold
  local venv=$1 e built=()
  shift
  for e in .venv-vllm .venv-vllm-*; do
    [ -f "$e/.eyrie-setup" ] && [ "$(realpath "$e")" != "$(realpath "$venv")" ] && built+=("$e")
  done
  [ ${#built[@]} -gt 0 ] || return 0
  local plan=$venv/.eyrie-plan.json spec
  # fast-deps: metadata by HTTP range requests, not whole wheels (1.7 GB for 0.34) held to the end
  "$venv/bin/python" -m pip install -qq --dry-run --use-feature=fast-deps --report "$plan" "$@" \
    || "$venv/bin/python" -m pip install -q --dry-run --report "$plan" "$@" || full "$venv"
  # the rest one at a time: pip holds every wheel of one command on disk until it ends
  for spec in $("$PY" scripts/seed_venv.py "$plan" "$venv" "${built[@]}"); do
    "$venv/bin/python" -m pip install -q --no-compile --no-deps "$spec" || full "$venv"
  done
  rm -f "$plan"
}

full() {  # full() VENV: pip failed; on a (nearly) full disk, one line saying so; exit 1 either way
  local dir free
  dir=$(dirname "$(realpath -m "$1")")
  free=$(df -Pk "$dir" | awk 'NR==2 {printf "%.1f", $4 / 1048576}')
  if awk "BEGIN {exit !($free < 1)}"; then
    echo "setup-vllm: building $1 stopped with $free GB free on $dir: the disk is full (a vLLM" \
      "environment takes up to 7 GB beyond the files it shares with those built). Free disk" \
      "there, or build one version (bash scripts/setup-vllm.sh 0.34); run again to go on" >&2
  fi
  exit 1
}

share() {  # share() VENV: hard-link its files that equal those of this checkout's other vLLM envs
  local envs=("$1") e
  for e in .venv-vllm .venv-vllm-*; do
    [ -d "$e" ] && [ "$(realpath "$e")" != "$(realpath "$1")" ] && envs+=("$e")
  done
  [ ${#envs[@]} -gt 1 ] || return 0
  if ! command -v hardlink >/dev/null; then
    echo "setup-vllm: no hardlink command (util-linux): the environments keep their own copies"
    return 0
  fi
  # same name, same bytes; -t: pip stamps a file with its install time, so equal files differ in it
  hardlink -q -t --respect-name --maximize "${envs[@]}"
  echo "setup-vllm: $1 shares its identical files with ${envs[*]:1}: $(du -shc "${envs[@]}" | tail -1 | cut -f1) on disk for all"
}

case "${1:-default}" in
  default) one envs/vllm.txt "${EYRIE_VLLM_VENV:-.venv-vllm}" ;;
  all)
    one envs/vllm.txt .venv-vllm
    for req in envs/vllm-*.txt; do
      v=${req#envs/vllm-}; one "$req" ".venv-vllm-${v%.txt}"
    done ;;
  *)
    req=envs/vllm-$1.txt
    [ -f "$req" ] || { echo "setup-vllm: no $req (versions: $(ls envs/vllm*.txt | tr '\n' ' '))" >&2; exit 2; }
    one "$req" "${EYRIE_VLLM_VENV:-.venv-vllm-$1}" ;;
esac
