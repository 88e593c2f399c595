#!/usr/bin/env bash
# The accelerator-step run from a checkout with no install: scripts/gpu_step.sh [OUT_DIR] [--cpu-smoke]
# (under 6 minutes on one H200). First scripts/gpu_step.py (the Pallas kernel against the jnp reference, engine
# steps with their MBU/MFU), then the profiler parts of the GPU check (scripts/gpu_all.py --only step,b8): TPOT
# end to end with the default loop and with k = 1, traces of 20 decode steps at 1 and 8 requests (top kernels,
# device busy against the step, device-to-host copies and host round trips a step), and synthetic-8b at 8 requests.
set -euo pipefail
OUT=${1:-${OUT:-out/gpu_step}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STEP_SMOKE=""
ALL_SMOKE=""
if [ "${2:-}" = "--cpu-smoke" ]; then STEP_SMOKE=--cpu-smoke; ALL_SMOKE=--smoke; fi
cd "$(dirname "$0")/.."
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the engine's KV budget, not XLA's arena, sizes memory
PY=$(command -v python3 || command -v python)  # CUDA images often have python3 only
timeout 140 "$PY" scripts/gpu_step.py "$OUT" --budget-s 120 $STEP_SMOKE || echo "gpu_step.py: exit $?"
exec timeout 200 "$PY" scripts/gpu_all.py "$OUT" --only step,b8 --total-s 190 $ALL_SMOKE
