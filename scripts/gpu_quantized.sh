#!/usr/bin/env bash
# The quantized-weights-and-KV run (scripts/gpu_quantized.py) from a checkout with no install:
# scripts/gpu_quantized.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the engine's KV budget, not XLA's arena, sizes memory
PY=$(command -v python3 || command -v python)  # CUDA images often have python3 only
exec timeout 330 "$PY" scripts/gpu_quantized.py "$@"
