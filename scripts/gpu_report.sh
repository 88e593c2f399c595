#!/usr/bin/env bash
# One prepared GPU run: calibrate + a short measured-vs-predicted report for the ~1B synthetic Llama in bf16.
#
#   scripts/gpu_report.sh [OUT_DIR]        # default: reports/gpu-<date>; under 8 minutes on one H100/H200
#
# Runs from a checkout with no install and no network (PYTHONPATH=.): needs jax (with CUDA), flax, numpy,
# click and jinja2; matplotlib is optional (without it, no report.png). Everything lands in OUT_DIR:
# env.txt (devices, versions), profile_step.txt (where a batch-1 decode step's time goes, without and with
# asynchronous scheduling, and with loops recorded into CUDA graphs), profile.json (calibrated hardware profile), report.json/.md/.png, run.log.
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
timeout 60 "$PY" scripts/profile_step.py --model synthetic-1b --dtype bfloat16 --batch 1 --steps 100 \
  --kv-cache-gib 1 --async-scheduling 2>&1 | grep -v "^WARNING" | tee -a "$OUT/profile_step.txt" || true
# An experiment, not a setting of ours: XLA runs a while loop by reading its condition back to the host every
# iteration; recording loops and conditionals into CUDA graphs (command buffers) would keep them on the device.
echo "with XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL:" >> "$OUT/profile_step.txt"
XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL timeout 60 "$PY" scripts/profile_step.py \
  --model synthetic-1b --dtype bfloat16 --batch 1 --steps 100 --kv-cache-gib 1 --async-scheduling 2>&1 \
  | grep -v "^WARNING" | tail -3 | tee -a "$OUT/profile_step.txt" || true

timeout 270 "$PY" - "$OUT" <<'PY' 2>&1 | tee "$OUT/run.log"
import importlib.util
import sys
import time

missing = [m for m in ("jax", "flax", "numpy", "click", "jinja2") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python packages: {', '.join(missing)}")
import jax

if jax.devices()[0].platform == "cpu":
    print("warning: no accelerator found; this run measures the CPU", flush=True)

from jaxserve.measure.report.run import run_report
from scripts.gpu_config import report_config

out = sys.argv[1]
cfg = report_config()
t0 = time.monotonic()
report = run_report(cfg, out, log=lambda m: print(f"[{time.monotonic() - t0:6.1f} s] {m}", flush=True))
print(open(f"{out}/report.md").read())
PY
echo "results in $OUT"
