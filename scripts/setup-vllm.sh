#!/usr/bin/env bash
# Creates a vLLM environment: vLLM (which pins its own torch) plus what eyrie's vLLM stages import,
# and eyrie itself. Idempotent. About 9 GB each from PyPI (README.md gives the time); files that
# two environments share (most of torch and its CUDA libraries) become one hard link after each
# install (util-linux's hardlink, where installed), so all three take ~18 GB instead of ~27: a
# CI machine once ran out of disk building them. pip replaces a file rather than writing into
# it, so an upgrade in one environment leaves the others as they were.
# A "# seed-from: ENV" line in a requirements file starts a new environment with ENV's torch and
# what torch requires, as hard links (same torch pin): pip finds them installed and unpacks the
# rest, so the disk never holds a second copy of torch's CUDA libraries, even for a moment (CI ran
# out of disk building 0.34 beside 0.33).
# Before each build the free disk is checked (12 GB, 4 with a seed; EYRIE_VLLM_MIN_FREE_GB): too little
# is one line naming the folder, the free and needed space, and the fix, not pip's Errno 28.
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
  if [ -n "$(seed_of "$req")" ]; then room "$venv" 4; else room "$venv" 12; fi
  if [ ! -x "$venv/bin/python" ]; then
    "$PY" -m venv "$venv"
    seed "$req" "$venv"
  fi
  "$venv/bin/python" -m pip install -q --upgrade pip "setuptools<82" wheel
  # a "# no-deps: SPEC" line: SPEC without its dependencies, first (a pin the registry lacks)
  local nodeps
  nodeps=$(sed -n 's/^# no-deps: //p' "$req")
  [ -z "$nodeps" ] || "$venv/bin/python" -m pip install -q --no-deps $nodeps
  "$venv/bin/python" -m pip install -q -r "$req"
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

room() {  # room() VENV GB: enough free disk for one build, or one line and exit 3
  local need=${EYRIE_VLLM_MIN_FREE_GB:-$2} dir free
  dir=$(dirname "$(realpath -m "$1")")
  free=$(df -Pk "$dir" | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$free" -lt "$need" ]; then
    echo "setup-vllm: $free GB free on $dir; building $1 needs about $need GB (vLLM with its torch)." \
      "Free disk there, build one version (bash scripts/setup-vllm.sh 0.34), or set" \
      "EYRIE_VLLM_MIN_FREE_GB if you know it needs less" >&2
    exit 3
  fi
}

seed_of() {  # seed_of() REQUIREMENTS: the built environment its "# seed-from:" line names, if any
  local from
  from=$(sed -n 's/^# seed-from: \([^ ]*\).*/\1/p' "$1")
  [ -n "$from" ] && [ -f "$from/.eyrie-setup" ] && echo "$from"
  return 0
}

seed() {  # seed() REQUIREMENTS VENV: a new VENV starts with its seed's torch, as hard links
  local from site
  from=$(seed_of "$1")
  [ -n "$from" ] || return 0
  site=$("$2/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # torch and what it requires (CUDA libraries, triton, sympy...), files and records, nothing else:
  # the new environment gets no package its own requirements would not install
  "$from/bin/python" - "$site" <<'PY'
import os
import sys
from importlib.metadata import distribution

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

site, todo, seen, files = sys.argv[1], ["torch"], set(), 0
while todo:
    name = canonicalize_name(todo.pop())
    if name in seen:
        continue
    seen.add(name)
    dist = distribution(name)
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
    for f in dist.files or []:
        src = os.path.realpath(dist.locate_file(f))
        if f.parts[0] == ".." or not os.path.isfile(src):
            continue  # console scripts: pip writes its own where a package is reinstalled
        dst = os.path.join(site, *f.parts)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.exists(dst):
            os.link(src, dst)
            files += 1
print(f"setup-vllm: seeded {len(seen)} packages ({files} files, hard links): {' '.join(sorted(seen))}")
PY
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
