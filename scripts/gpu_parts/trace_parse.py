"""Reads a `jax.profiler.trace(..., create_perfetto_trace=True)` of N engine steps: the kernels per step, the
device's busy time against the step, device-to-host copies per step and which of them a jitted program waited
on (a `cond`/`while` predicate read back: a host round trip inside the step).

On a GPU trace the kernels are the events of the `/device:GPU:N` processes (CUPTI); a CPU-only trace has none,
so there the XLA CPU runtime's thunk events (those with an `hlo_op`) stand in, and the same summary comes out.

    python3 -m scripts.gpu_parts.trace_parse TRACE.json.gz STEPS
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import sys
from pathlib import Path
from typing import Any

STEP_EVENT = re.compile(r"^\$llm_engine\.py:\d+ step$")  # the python tracer's event of LLMEngine.step
COPY = re.compile(r"^Memcpy(D2H|DtoH|H2D|HtoD|D2D|DtoD|P2P)")
ROUND_TRIP_OPS = ("cond", "conditional", "while")


def load_events(path: str | Path) -> list[dict[str, Any]]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total time covered by (start, end) intervals (several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def device_events(events: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """("gpu", the device processes' complete events) or, with no device process, ("cpu", XLA's thunk events)."""
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in procs.items() if name.startswith("/device:")}
    done = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if device_pids:
        return "gpu", [e for e in done if e["pid"] in device_pids]
    return "cpu", [e for e in done if "hlo_op" in e.get("args", {}) and not e["name"].startswith("end: ")]


def summarize(events: list[dict[str, Any]], steps: int, top: int = 12) -> dict[str, Any]:
    """Per step: the device's kernels (count, busy time as the union of their intervals, the top `top` by time),
    the traced step (the mean `LLMEngine.step` event, else the device span over `steps`), copies by direction,
    and the device-to-host copies a jitted program issued for a conditional or loop bound (host round trips)."""
    kind, dev = device_events(events)
    copies = [e for e in dev if COPY.match(e["name"])]
    kernels = [e for e in dev if not COPY.match(e["name"]) and not e["name"].startswith("Memset")]
    host_steps = [e["dur"] for e in events if e.get("ph") == "X" and STEP_EVENT.match(e.get("name", ""))]
    span = (max(e["ts"] + e["dur"] for e in dev) - min(e["ts"] for e in dev)) if dev else 0.0
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
    d2h = [e for e in copies if re.match(r"^Memcpy(D2H|DtoH)", e["name"])]
    round_trips = [e for e in d2h if e.get("args", {}).get("hlo_module")
                   and e["args"].get("hlo_op", "").split(".")[0] in ROUND_TRIP_OPS]
    if kind == "cpu":  # XLA's CPU runtime runs a conditional or while loop as thunks named after the op
        round_trips = [e for e in kernels if e["args"]["hlo_op"].split(".")[0] in ROUND_TRIP_OPS]
    order = sorted(kernels, key=lambda e: e["ts"])
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(order, order[1:], strict=False)]
    n = max(1, steps)
    return {
        "source": kind, "steps": steps,
        "step_us": (sum(host_steps) / len(host_steps)) if host_steps else span / n,
        "step_source": "LLMEngine.step events" if host_steps else "device span / steps",
        "busy_us": _union_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels]) / n,
        "span_us": span / n,
        "kernels_per_step": len(kernels) / n,
        "idle_gaps_over_50us_per_step": sum(g for g in gaps if g > 50) / n,
        "d2h_per_step": len(d2h) / n, "h2d_per_step": sum(1 for e in copies if re.match(r"^Memcpy(H2D|HtoD)",
                                                                                       e["name"])) / n,
        "host_round_trips_per_step": len(round_trips) / n,
        "round_trip_ops": sorted({e.get("args", {}).get("hlo_op", "") for e in round_trips})[:8],
        "top_kernels": [{"name": name[:120], "us_per_step": t / n, "count_per_step": c / n}
                        for name, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]],
    }


def summarize_file(path: str | Path, steps: int, top: int = 12) -> dict[str, Any]:
    return summarize(load_events(path), steps, top)


def kernel_us(summary: dict[str, Any], pattern: str) -> float | None:
    """Microseconds a step of the top kernels whose name matches `pattern` (a regular expression); None when
    none does (a CPU trace names its custom calls `ffi_call.N`)."""
    found = [k["us_per_step"] for k in summary["top_kernels"] if re.search(pattern, k["name"])]
    return sum(found) if found else None


def render(summary: dict[str, Any], label: str) -> list[str]:
    """A few lines for the log: busy against the step, copies, then the top kernels."""
    s = summary
    lines = [f"{label}: step {s['step_us']:.0f} us ({s['step_source']}), device busy {s['busy_us']:.0f} us "
             f"({s['busy_us'] / max(s['step_us'], 1e-9):.0%}), {s['kernels_per_step']:.0f} kernels, "
             f"D2H {s['d2h_per_step']:.1f}, H2D {s['h2d_per_step']:.1f}, host round trips "
             f"{s['host_round_trips_per_step']:.1f} a step {s['round_trip_ops'] or ''}"]
    lines += [f"    {k['us_per_step']:9.1f} us {k['count_per_step']:6.1f}x  {k['name'][:90]}" for k in s["top_kernels"]]
    return lines


if __name__ == "__main__":
    print("\n".join(render(summarize_file(sys.argv[1], int(sys.argv[2])), sys.argv[1])))
