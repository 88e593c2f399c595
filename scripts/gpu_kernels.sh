#!/usr/bin/env bash
# The decode-step kernel microbenchmarks (scripts/gpu_kernels.py) from a checkout with no install:
# scripts/gpu_kernels.sh [OUT_DIR]   (under 2 minutes on one H200)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the benchmark's arrays, not XLA's arena, size memory
PY=$(command -v python3 || command -v python)  # CUDA images often have python3 only
exec timeout 170 "$PY" scripts/gpu_kernels.py "$@"
