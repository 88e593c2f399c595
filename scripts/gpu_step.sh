#!/usr/bin/env bash
# The accelerator-step run (scripts/gpu_step.py) from a checkout with no install: scripts/gpu_step.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the engine's KV budget, not XLA's arena, sizes memory
PY=$(command -v python3 || command -v python)  # CUDA images often have python3 only
exec timeout 360 "$PY" scripts/gpu_step.py "$@"
