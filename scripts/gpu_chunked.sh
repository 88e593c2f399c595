#!/usr/bin/env bash
# A short GPU check (about 3 minutes on one H200, most of it compiling): a batch-1 decode step's profile, then
# the report's chunked-prefill rows alone (calibrate, then a 4096-token prompt beside 8 running decodes with
# the planner's chunk and without chunking), for the synthetic-1b preset in bf16 (scripts/gpu_config.py).
#
#   scripts/gpu_chunked.sh [OUT_DIR]        # default: reports/gpu-chunked-<date>
#
# For when a full `gpu_report.sh` does not fit the device time left. Same needs: jax with CUDA, flax, numpy,
# click, jinja2; runs from a checkout (PYTHONPATH=.). Writes profile_step.txt, profile.json, chunked.json, run.log.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-reports/gpu-chunked-$(date +%Y%m%d-%H%M%S)}
# `MODEL=tiny DTYPE=float32 KV_GIB=1 scripts/gpu_chunked.sh` checks the script itself on a CPU.
MODEL=${MODEL:-synthetic-1b}
DTYPE=${DTYPE:-bfloat16}
KV_GIB=${KV_GIB:-24}
mkdir -p "$OUT"
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=$(command -v python3 || command -v python)

timeout 60 "$PY" scripts/profile_step.py --model "$MODEL" --dtype "$DTYPE" --batch 1 --steps 100 \
  --kv-cache-gib 1 2>&1 | grep -v "^WARNING" | tee "$OUT/profile_step.txt" || true

timeout 240 "$PY" - "$OUT" "$MODEL" "$DTYPE" "$KV_GIB" <<'PY' 2>&1 | tee "$OUT/run.log"
import json
import sys
import time

from jaxserve.measure.calibrate.calibrate import calibrate
from jaxserve.model.dtypes import planner_dtype
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.measure.report.context import Context
from jaxserve.measure.report.chunked import run_chunked
from scripts.gpu_config import report_config

out, model, dtype, kv_gib = sys.argv[1:5]
cfg = report_config(model, dtype, float(kv_gib))
t0 = time.monotonic()
log = lambda m: print(f"[{time.monotonic() - t0:6.1f} s] {m}", flush=True)  # noqa: E731
engine = LLMEngine(cfg.engine_config())
log(f"engine ready (buckets {engine.runner.token_buckets})")
cal = calibrate(engine, cfg.calibration, lambda phase, frac: log(f"calibrate: {phase}") if frac < 1 else None)
cal.save(f"{out}/profile.json")
log(f"calibrated: step fit median |error| {cal.fit.median_abs_error:.1%}")
ctx = Context(engine=engine, spec=engine.spec, hw=cal.hardware, dtype=planner_dtype(engine.dtype), cfg=cfg, log=log)
rows = run_chunked(ctx)
with open(f"{out}/chunked.json", "w") as f:
    json.dump(rows, f, indent=2)
for r in rows:
    print(r["config"]["mode"], {k: round(v, 3) for k, v in r.items() if isinstance(v, float)
                                and ("over_undisturbed" in k or "itl_ms" in k or "error" in k)})
PY
echo "results in $OUT"
