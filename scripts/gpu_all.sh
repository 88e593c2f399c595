#!/usr/bin/env bash
# Every prepared GPU check in one call (scripts/gpu_all.py; docs/gpu_checks.md), from a checkout with no install:
#   PYTHONUNBUFFERED=1 bash scripts/gpu_all.sh OUTDIR [--smoke] [--only PART,...]
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: scripts/gpu_all.sh OUTDIR [--smoke] [--only PART,...]" >&2; exit 2; }
mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
shift
cd "$(dirname "$0")/.."
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the engines' KV budgets, not XLA's arena, size memory
PY=$(command -v python3 || command -v python)  # CUDA images often have python3 only
exec timeout 590 "$PY" scripts/gpu_all.py "$OUTDIR" "$@"
