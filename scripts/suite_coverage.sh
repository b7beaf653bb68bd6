#!/usr/bin/env bash
# The README's test command, its three phases timed, under coverage.py (pyproject.toml's
# [tool.coverage]: the package's lines, subprocesses included), with an empty compilation cache
# unless JAX_COMPILATION_CACHE_DIR is set: `bash scripts/suite_coverage.sh [OUT_DIR]`.
# Prints one JSON line (phase seconds, exit codes, line coverage of diloco/); writes the
# per-test durations and the coverage report into OUT_DIR (default /tmp/suite_coverage).
# COVERAGE=0 runs the same without coverage (the timing alone).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/suite_coverage}
mkdir -p "$out"
rm -rf .coverage-data
mkdir -p .coverage-data
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
  export JAX_COMPILATION_CACHE_DIR
fi
wrap=(python -m coverage run -m pytest)
if [ "${COVERAGE:-1}" = "0" ]; then wrap=(python -m pytest); fi
phase() {  # NAME PYTEST_ARGS...
  local name=$1; shift
  local start=$SECONDS
  "${wrap[@]}" -q -p no:cacheprovider --durations=0 "$@" tests > "$out/$name.log" 2>&1
  local rc=$?
  echo "\"$name\": {\"s\": $((SECONDS - start)), \"rc\": $rc}"
}
fast=$(phase fast -n 2 --dist loadfile -m "not processes")
processes=$(phase processes -n 2 --dist loadfile -m "processes and not gloo")
gloo=$(phase gloo -m gloo)
percent=null
if [ "${COVERAGE:-1}" != "0" ]; then
  python -m coverage combine -q > /dev/null 2>&1
  python -m coverage report > "$out/coverage.txt" 2>&1
  percent=$(python -m coverage report --format=total 2>/dev/null || echo null)
fi
echo "{$fast, $processes, $gloo, \"line_coverage_percent\": $percent}"
