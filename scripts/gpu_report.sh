#!/usr/bin/env bash
# One prepared GPU run: calibrate + a short measured-vs-predicted report for the ~1B synthetic Llama, in bf16 and
# with --quantization fp8.
#
#   scripts/gpu_report.sh [OUT_DIR]        # default: reports/gpu-<date>; under 6 minutes on one H100/H200
#
# Runs from a checkout with no install and no network (PYTHONPATH=.): needs jax (with CUDA), flax, numpy,
# click and jinja2; matplotlib is optional (without it, no report.png). Everything lands in OUT_DIR:
# env.txt (devices, versions), profile_step.txt (where a batch-1 decode step's time goes), report_bf16/ and
# report_fp8/ (profile.json: the calibrated hardware profile; report.json/.md/.png), report.json (the figures
# against the targets), summary.md, run.log.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-reports/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # let the engine's KV budget, not XLA's arena, size memory
PY=$(command -v python3 || command -v python)  # CUDA images often have python3 only

{ date; nvidia-smi 2>/dev/null || true; "$PY" -c "import jax, flax; print('jax', jax.__version__, 'flax',
flax.__version__); print(jax.devices())"; } > "$OUT/env.txt" 2>&1 || true

timeout 60 "$PY" scripts/profile_step.py --model synthetic-1b --dtype bfloat16 --batch 1 --steps 100 \
  --kv-cache-gib 1 2>&1 | grep -v "^WARNING" | tee -a "$OUT/profile_step.txt" || true
# Calibrate + report on synthetic-1b in bf16, then with --quantization fp8 (scripts/gpu_parts/report.py, sized by
# scripts/gpu_config.budget_report_config): report_bf16/ and report_fp8/ under OUT, report.json the figures.
timeout 290 "$PY" scripts/gpu_all.py "$OUT" --only report --total-s 280 2>&1 | tee "$OUT/run.log"
echo "results in $OUT"
