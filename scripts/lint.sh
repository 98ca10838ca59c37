#!/usr/bin/env bash
# The lint gates of the test suite (tests/house/test_lint.py, tests/house/test_layout.py), runnable alone:
# ruff check and ruff format (settings in pyproject.toml), snakefmt over the Snakefile and rules/,
# `snakemake --lint` (less the lints tests/house/test_lint.py keeps) and a dry run of the tiny config (.test/config.yaml), the import boundaries.
# Every gate runs; the exit status is 1 if any failed.
#   bash scripts/lint.sh         check
#   bash scripts/lint.sh --fix   first rewrite what the formatters can (ruff --fix, ruff format,
#                                snakefmt), then check
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [ "${1:-}" = "--fix" ]; then
  $PY -m ruff check --fix --quiet .
  $PY -m ruff format --quiet .
  $PY -m snakefmt Snakefile rules/
fi
# convs.jsonl is the conversations file the tiny config names, relative to the working directory
work=$(mktemp -d) && touch "$work/convs.jsonl" && trap 'rm -rf "$work"' EXIT
smk=($PY -m snakemake -s "$PWD/Snakefile" -d "$work" --configfile "$PWD/.test/config.yaml")
failed=()
gate() {  # gate NAME COMMAND...: run COMMAND, remember NAME if it fails
  local name=$1; shift
  echo "== $name"
  "$@" || failed+=("$name")
}
gate "ruff check" $PY -m ruff check --output-format concise .
gate "ruff format" $PY -m ruff format --check .
gate "snakefmt" $PY -m snakefmt --check --compact-diff Snakefile rules/
# snakemake --lint exits 1 while any lint is left: the test keeps the reasoned ones (KEPT_LINTS)
gate "snakemake --lint" $PY -m pytest -q -p no:cacheprovider tests/house/test_lint.py -k snakemake_lint
gate "dry run of .test/config.yaml" "${smk[@]}" -n --quiet
gate "import boundaries" $PY -m pytest -q -p no:cacheprovider tests/house/test_layout.py
if [ ${#failed[@]} -gt 0 ]; then
  printf 'lint: failed: %s\n' "$(IFS=,; echo "${failed[*]}" | sed 's/,/, /g')"
  exit 1
fi
echo "lint: all gates pass"
