"""Predictions against published measurements of mature engines (planner/published_points.json).

Each point is predicted with the catalog hardware and its default priors (global, never per point):
- `first_token`: one prefill step of `input_len` tokens at batch 1 -> TTFT;
- `static_batch`: one context step for the batch, then output_len - 1 decode steps -> ms per output token
  (the TPOT group: a decode-speed figure);
- `serving_concurrency`: the closed-form serving model with closed-loop clients -> mean TTFT and TPOT.
`scripts/validate_planner.py` prints the table; the test asserts the target medians.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from modelspec.spec import load_model_spec
from planner.hardware import Hardware, load_hardware
from planner.serving import ServingConfig, Workload, predict_serving
from planner.step_model import decode_shape, prefill_shape, step_time_shape

POINTS_PATH = Path(__file__).with_name("published_points.json")


@dataclass
class Comparison:
    """One published figure beside the planner's prediction."""

    id: str
    metric: str  # "ttft" or "tpot"
    measured_ms: float
    predicted_ms: float
    source: str
    roofline_ms: float | None = None  # the pure roofline floor for the same figure (step-level points)

    @property
    def error(self) -> float:
        return (self.predicted_ms - self.measured_ms) / self.measured_ms


def load_points(path: Path = POINTS_PATH) -> list[dict[str, Any]]:
    return json.loads(Path(path).read_text())["points"]


def _static_batch_ms_per_token(p: dict[str, Any], hw: Hardware) -> tuple[float, float]:
    spec = load_model_spec(p["model"])
    b, isl, osl = p["batch"], p["input_len"], p["output_len"]
    kw = dict(tp=p["tp"], dtype=p["dtype"], kv_dtype=p["kv_dtype"])
    ctx_shape = prefill_shape(isl, 0)
    shape = ctx_shape
    for _ in range(b - 1):
        shape = shape + ctx_shape
    first = step_time_shape(spec, hw, shape, **kw)
    total, floor = first.total_s, first.roofline_s
    steps = osl - 1
    if steps > 0:  # decode steps at contexts isl+1 .. isl+osl-1, integrated on a few nodes (linear in context)
        ctxs = np.linspace(isl + 1, isl + osl - 1, 5)
        times = [step_time_shape(spec, hw, decode_shape(b, float(c)), **kw) for c in ctxs]
        total += steps * float(np.mean([t.total_s for t in times]))
        floor += steps * float(np.mean([t.roofline_s for t in times]))
    return total / osl * 1e3, floor / osl * 1e3


def predict_point(p: dict[str, Any], hardware: Hardware | None = None) -> list[Comparison]:
    """The planner's predictions for one published point (one or two metrics)."""
    hw = hardware or load_hardware(p["hardware"])
    src = p["source"]["title"]
    spec = load_model_spec(p["model"])
    if p["kind"] == "first_token":
        t = step_time_shape(spec, hw, prefill_shape(p["input_len"], 0), tp=p["tp"], dtype=p["dtype"],
                            kv_dtype=p["kv_dtype"])
        return [Comparison(p["id"], "ttft", p["measured"]["ttft_ms"], t.total_s * 1e3, src, t.roofline_s * 1e3)]
    if p["kind"] == "static_batch":
        pub = p["published"]
        if "latency_ms" in pub:
            measured = pub["latency_ms"] / p["output_len"]
        else:
            measured = 1e3 * p["batch"] / (pub["out_tok_s_per_gpu"] * p["tp"])
        predicted, floor = _static_batch_ms_per_token(p, hw)
        return [Comparison(p["id"], "tpot", measured, predicted, src, floor)]
    if p["kind"] == "serving_concurrency":
        cfg = ServingConfig(tp=p["tp"], max_num_seqs=p.get("max_num_seqs", 256), chunk_size=p.get("chunk_size", 8192),
                            dtype=p["dtype"], kv_dtype=p["kv_dtype"])
        wl = Workload(input_len=p["input_len"], output_len=p["output_len"], concurrency=p["concurrency"])
        pred = predict_serving(spec, hw, wl, cfg)
        return [Comparison(p["id"], "ttft", p["measured"]["ttft_ms"], pred.ttft.mean, src),
                Comparison(p["id"], "tpot", p["measured"]["tpot_ms"], pred.tpot.mean, src)]
    raise ValueError(f"unknown point kind {p['kind']!r}")


def compare_all(path: Path = POINTS_PATH) -> list[Comparison]:
    return [c for p in load_points(path) for c in predict_point(p)]


def median_abs_errors(rows: list[Comparison], roofline: bool = False) -> dict[str, float]:
    """Median absolute relative error per metric group ("ttft", "tpot"); `roofline`: of the pure floor instead
    (over the step-level points only)."""
    out = {}
    for metric in ("ttft", "tpot"):
        if roofline:
            errs = [abs(r.roofline_ms / r.measured_ms - 1) for r in rows
                    if r.metric == metric and r.roofline_ms is not None]
        else:
            errs = [abs(r.error) for r in rows if r.metric == metric]
        out[metric] = median(errs) if errs else float("nan")
    return out


def table(rows: list[Comparison]) -> str:
    """The comparison as a markdown table."""
    lines = ["| point | metric | measured ms | predicted ms | error | roofline ms |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        floor = "-" if r.roofline_ms is None else f"{r.roofline_ms:.2f}"
        lines.append(f"| {r.id} | {r.metric} | {r.measured_ms:.2f} | {r.predicted_ms:.2f} | {r.error:+.0%} | {floor} |")
    return "\n".join(lines)
