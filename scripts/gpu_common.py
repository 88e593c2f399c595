"""What the prepared GPU scripts share: their start (arguments, output folder, stamped log), their end (json, md),
a guard that records a part's error and goes on, and a median timer. No engine imports: a kernel script runs on
an image that lacks the engine's optional pieces."""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np


def median_time(fn, reps: int) -> float:
    """Median seconds of `fn()` (blocked until ready) over `reps` calls after one untimed call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def guarded(fn, log) -> dict[str, Any]:
    """fn()'s result, or the error it raised (the run goes on)."""
    try:
        return fn()
    except Exception as e:
        log(traceback.format_exc())
        return {"error": f"{type(e).__name__}: {e}"}


def begin(description: str, default_out: str, budget_s: float
          ) -> tuple[argparse.Namespace, Path, Callable[[str], None], float]:
    """What every prepared GPU script starts with: its arguments (OUT_DIR, --cpu-smoke, --budget-s), the output
    folder (made), a log that stamps seconds since the start, and that start."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("out", nargs="?", default=os.environ.get("OUT") or default_out)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on a CPU (kernels interpreted)")
    ap.add_argument("--budget-s", type=float, default=budget_s, help="skip parts that would start after this")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)

    if jax.devices()[0].platform == "cpu" and not args.cpu_smoke:
        log("warning: no accelerator; the figures below measure this CPU")
    return args, out, log, t0


def finish(out: Path, name: str, report: dict[str, Any], render: Callable[[dict[str, Any]], str],
           log: Callable[[str], None], t0: float) -> None:
    """Stamp the elapsed time, write OUT/name.json and OUT/name.md (`render`'s), and print the latter."""
    report["elapsed_s"] = time.perf_counter() - t0
    (out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    text = render(report)
    (out / f"{name}.md").write_text(text)
    print(text)
    log(f"wrote {out}/{name}.json and {name}.md")
