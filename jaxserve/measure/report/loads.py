"""The report's online-load part: Poisson loads at fractions of the planner's predicted capacity, each
predicted by the planner's simulator on the run's own arrival times, with a step-level check that predicts
every measured step from its own shape (`predict_step_s`, also used by the chunked-prefill part).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from jaxserve.measure.bench.datasets import DatasetConfig, generate
from jaxserve.measure.bench.load import LoadConfig, RunResult, StepRecord, arrival_offsets, run_engine
from jaxserve.measure.bench.results import compute_metrics
from jaxserve.measure.report.context import Context, avoid_tokens, error_pct, fmt, result_row
from planner.serving import Workload, predict_serving
from planner.simulate import simulate
from planner.step_model import StepShape, decode_shape, pad_tokens, prefill_shape, step_time_shape


def run_loads(ctx: Context) -> list[dict[str, Any]]:
    """Poisson loads at fractions of the planner's predicted capacity.

    A run of `load_num_prompts` requests from an empty engine is a transient, and its Poisson trace is one
    draw (seed 0's 47 gaps average 1.09x the mean, one of them 6x, a lull that drains the engine), so the
    prediction of the run is the planner's simulator on the very arrival times the engine gets; the closed
    form (steady state of an endless Poisson stream) and its error are beside it.
    """
    cfg = ctx.cfg
    wl = Workload(input_len=cfg.load_input_len, output_len=cfg.load_output_len)
    base = predict_serving(ctx.spec, ctx.hw, replace(wl, request_rate=1.0), ctx.serving_config())
    capacity = base.capacity_requests_per_s
    rows = []
    for frac in cfg.load_fractions:
        rate = frac * capacity
        w = replace(wl, request_rate=rate)
        load = LoadConfig(request_rate=rate, seed=cfg.seed)
        closed = predict_serving(ctx.spec, ctx.hw, w, ctx.serving_config())
        sim = simulate(ctx.spec, ctx.hw, w, ctx.serving_config(), warmup_fraction=0.0,
                       arrival_times=arrival_offsets(cfg.load_num_prompts, rate, load.burstiness, load.seed))
        reqs = generate(DatasetConfig(name="random", num_prompts=cfg.load_num_prompts, input_len=cfg.load_input_len,
                                      output_len=cfg.load_output_len, seed=cfg.seed + int(frac * 100)),
                        ctx.spec.vocab_size, avoid_tokens(ctx))
        run = run_engine(ctx.engine, reqs, load, salt=ctx.next_salt())
        m = compute_metrics(run.records, run.duration)
        steps = _step_check(ctx, run)
        rows.append(result_row("load", {"load_fraction": frac, "request_rate": rate, "input_len": cfg.load_input_len,
                                  "output_len": cfg.load_output_len, "num_prompts": cfg.load_num_prompts},
                         {"ttft_ms": sim.ttft.mean, "tpot_ms": sim.tpot.mean, "throughput": sim.output_tokens_per_s},
                         {"ttft_ms": m["mean_ttft_ms"], "tpot_ms": m["mean_tpot_ms"],
                          "throughput": m["output_throughput"]},
                         predicted_capacity_rps=capacity, closed_form_ttft_ms=closed.ttft.mean,
                         closed_form_tpot_ms=closed.tpot.mean,
                         closed_form_ttft_error_pct=error_pct(closed.ttft.mean, m["mean_ttft_ms"]),
                         closed_form_tpot_error_pct=error_pct(closed.tpot.mean, m["mean_tpot_ms"]),
                         measured_p99_ttft_ms=m["p99_ttft_ms"], predicted_p99_ttft_ms=sim.ttft.p99,
                         completed=m["completed"], failed=m["failed"],
                         predicted_decode_batch=sim.mean_decode_batch,
                         closed_form_decode_batch=closed.decode_batch, **steps))
        ctx.log(f"load {frac:.0%} of {capacity:.2f} req/s: TTFT {m['mean_ttft_ms']:.1f} ms (pred {sim.ttft.mean:.1f},"
                f" closed form {closed.ttft.mean:.1f}), TPOT {m['mean_tpot_ms']:.2f} ms (pred {sim.tpot.mean:.2f}, "
                f"closed form {closed.tpot.mean:.2f}); steps measured/predicted: decode "
                f"{fmt(steps['measured_over_predicted_decode_step'], '.2f')}, prefill "
                f"{fmt(steps['measured_over_predicted_prefill_step'], '.2f')}; decode batch "
                f"{fmt(steps['measured_decode_batch'], '.2f')} (pred {sim.mean_decode_batch:.1f})")
    return rows


def predict_step_s(ctx: Context, step: StepRecord) -> float | None:
    """The step model's time for one measured step, from its own shape (the engine's StepStats: decode
    contexts, prefill chunks) at its padded token count (the engine's bucket); None for an empty step."""
    shape = StepShape()
    if step.num_decodes:  # decode_shape charges context + 1 per sequence; the engine counts KV incl. the new token
        shape = decode_shape(step.num_decodes, max(0.0, step.decode_context_tokens / step.num_decodes - 1))
    for q, done in step.prefill_chunks:
        shape = shape + prefill_shape(q, done)
    if shape.num_tokens == 0:
        return None
    return step_time_shape(ctx.spec, ctx.hw, shape, **ctx.dtypes,
                           padded_tokens=pad_tokens(shape.num_tokens, ctx.engine.runner.token_buckets)).total_s


def _step_check(ctx: Context, run: RunResult) -> dict[str, float | None]:
    """Step-level check of a load run: measured step time over the step model's, median per kind of step.

    Each step is predicted from its own shape (`predict_step_s`): an error here is the step model's; an error
    only in TTFT/TPOT is the serving model's (queueing, batching).
    """
    ratios: dict[str, list[float]] = {"decode": [], "mixed": []}
    for s in run.steps:
        pred = predict_step_s(ctx, s)
        if pred is None or s.duration <= 0:
            continue
        ratios["mixed" if s.num_prefill_tokens else "decode"].append(s.duration / pred)
    decodes = [s.num_decodes for s in run.steps]
    return {"measured_over_predicted_decode_step": float(np.median(ratios["decode"])) if ratios["decode"] else None,
            "measured_over_predicted_prefill_step": float(np.median(ratios["mixed"])) if ratios["mixed"] else None,
            "measured_decode_batch": float(np.mean(decodes)) if decodes else None,
            "measured_steps": len(run.steps)}
