"""The report's chunked-prefill part: decodes running while a long prompt arrives, with and without chunking.

The planner picks the chunk (`choose_chunk_size`) for an ITL target of 2x its predicted undisturbed TPOT; the
runtime runs the `long-prompt` workload with the long prompt cut into chunks that fit that step budget beside
the decodes, then with one chunk that takes the whole prompt in one step. Each gap between two tokens of a
running decode is attributed to the engine step that produced the later token: gaps of steps without prefill
give the undisturbed TPOT, all gaps give p99 and max ITL. The prediction builds the same gap list from
`chunked_prefill_itls` (page-aligned chunks as the runtime cuts them, or a part of a page when even one page
per step misses the target). The predicted undisturbed TPOT is the step model's time of those same quiet steps
(each from its own shape): most of them come after the long prompt, when the decodes' contexts have grown by
its whole length in chunked steps, so a forecast at their starting context would compare a short-context step
with long-context ones (an error of the comparison; docs/tuning.md).
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import numpy as np

from jaxserve.measure.bench.datasets import DatasetConfig, generate
from jaxserve.measure.bench.load import LoadConfig, RunResult, run_engine
from jaxserve.measure.calibrate.steps import step_budget
from jaxserve.measure.report.context import ReportConfig
from jaxserve.measure.report.loads import predict_step_s
from jaxserve.model.attention.backend import smallest_chunk
from jaxserve.platform.attention_choice import finest_chunk
from planner.api import choose_chunk_size, chunked_prefill_itls
from planner.step_model import decode_shape, step_time_shape

WARM_TOKENS = 8


def decode_gaps(run: RunResult, decodes: int | None = None) -> tuple[list[float], list[float], list[int]]:
    """(all gaps, undisturbed gaps, the step index of each undisturbed gap) of the `decode` requests, in ms.

    Undisturbed: the step had no prefill (and, given `decodes`, exactly that many decodes: once the long
    prompt decodes beside them its 4k-token context makes every step slower).
    """
    ends = [s.end for s in run.steps]
    all_gaps, quiet, quiet_steps = [], [], []
    for rec, times in zip(run.records, run.token_times, strict=True):
        if rec.role != "decode":
            continue
        for a, b in zip(times, times[1:], strict=False):
            k = min(bisect.bisect_left(ends, b - 1e-9), len(ends) - 1)
            gap = (b - a) * 1e3
            all_gaps.append(gap)
            step = run.steps[k]
            if step.num_prefill_tokens == 0 and (decodes is None or step.num_decodes == decodes):
                quiet.append(gap)
                quiet_steps.append(k)
    return all_gaps, quiet, quiet_steps


def _long_output_len(cfg: ReportConfig, prefill_per_step: int) -> int:
    """Tokens each request of a long-prompt run generates: warm-up, one per chunk of the long prompt, the tail."""
    return WARM_TOKENS + math.ceil(cfg.long_prompt_len / prefill_per_step) + cfg.long_tail_tokens


def check_long_prompt_fits(cfg: ReportConfig, max_model_len: int, page_size: int) -> None:
    """Raise ValueError if the long prompt and the most tokens it may be asked to generate (chunks of at least
    the finest any attention backend takes) exceed the engine's context, before calibrating or measuring anything."""
    most = cfg.long_prompt_len + _long_output_len(cfg, finest_chunk(page_size))
    if most > max_model_len:
        raise ValueError(f"the chunked-prefill run needs up to {most} tokens of context (a {cfg.long_prompt_len}-token "
                         f"prompt and its outputs) but the model's max_model_len is {max_model_len}: "
                         f"lower --long-prompt-len")


def _predicted_gaps(undisturbed_ms: float, stalls_ms: list[float], gaps_per_request: int) -> list[float]:
    return [undisturbed_ms] * max(0, gaps_per_request - len(stalls_ms)) + stalls_ms


def run_chunked(ctx) -> list[dict[str, Any]]:
    """Rows for the chunked and the unchunked long-prompt runs (see the module docstring)."""
    cfg, engine = ctx.cfg, ctx.engine
    d, length, page = cfg.long_decodes, cfg.long_prompt_len, engine.config.page_size
    context = cfg.long_decode_input + WARM_TOKENS
    buckets = engine.runner.token_buckets
    kw = dict(decode_batch=d, context_len=context, **ctx.dtypes, token_buckets=buckets)
    undisturbed = step_time_shape(ctx.spec, ctx.hw, decode_shape(d, context), **ctx.dtypes).total_ms
    target = 2 * undisturbed
    choice = choose_chunk_size(ctx.spec, ctx.hw, target, prompt_len=length, page_size=page,
                               min_chunk=smallest_chunk(engine.runner.ops.attention, page), **kw)
    # The runtime cuts chunks on page boundaries: give it a budget of whole pages plus the decodes, so every
    # step prefills exactly `per_step` tokens, as predicted.
    # It also pads a step to its token bucket, so the budget is the largest bucket within the planner's chunk.
    # A chunk of less than a page (a tight target on a CPU) is taken as the planner gives it.
    if choice.chunk_size - d < page:
        per_step = choice.chunk_size - d
    else:
        fitting = [b for b in buckets if b <= choice.chunk_size and b - d >= page]
        per_step = max(page, ((max(fitting) if fitting else choice.chunk_size) - d) // page * page)
    rows = []
    # The budget limits the chunk alone: the decodes' own prompts prefill side by side at the start, so all
    # `d` decode in step before the long prompt lands, and it alone is cut into `prefill`-token chunks.
    for label, budget, prefill in (("chunked", per_step + d, per_step), ("unchunked", cfg.budget, length)):
        stalls = [t * 1e3 for t in chunked_prefill_itls(ctx.spec, ctx.hw, length, prefill + d, **kw)]
        out_len = _long_output_len(cfg, prefill)
        reqs = generate(DatasetConfig(name="long-prompt", num_prompts=d + 1, input_len=cfg.long_decode_input,
                                      output_len=out_len, long_prompt_len=length, warm_tokens=WARM_TOKENS,
                                      seed=cfg.seed + budget), ctx.spec.vocab_size, ())
        with step_budget(engine, cfg.budget, chunk=prefill):
            run = run_engine(engine, reqs, LoadConfig(), salt=ctx.next_salt())
        gaps, quiet, quiet_steps = decode_gaps(run, d)
        replayed = [predict_step_s(ctx, run.steps[k]) for k in quiet_steps]
        quiet_pred = float(np.median([t for t in replayed if t])) * 1e3 if any(replayed) else undisturbed
        pred_gaps = _predicted_gaps(quiet_pred, stalls, out_len - 1) * d  # pooled over the decodes, as measured
        long_rec = next(r for r in run.records if r.role == "long")
        if not long_rec.success:
            raise ValueError(f"the long prompt of the {label} run failed ({long_rec.error}): its ITL figures would "
                             f"not show a prefill")
        meas = {"undisturbed": float(np.median(quiet)) if quiet else math.nan,
                "p99": float(np.percentile(gaps, 99)) if gaps else math.nan, "max": max(gaps, default=math.nan)}
        pred = {"undisturbed": quiet_pred, "p99": float(np.percentile(pred_gaps, 99)), "max": max(pred_gaps)}
        row = {"kind": "chunked-prefill", "config": {
            "mode": label, "step_budget": budget, "planner_chunk": choice.chunk_size,
            "prefill_tokens_per_step": prefill, "prompt_len": length,
            "decodes": d, "decode_context": context, "itl_target_ms": target,
            "forecast_undisturbed_itl_ms": undisturbed},
            "predicted_ttft_ms": sum(stalls), "measured_ttft_ms": long_rec.ttft * 1e3 if long_rec.success else None,
            "predicted_tpot_ms": pred["undisturbed"], "measured_tpot_ms": meas["undisturbed"],
            "predicted_throughput": None, "measured_throughput": None}
        for k in ("undisturbed", "p99", "max"):
            row[f"predicted_{k}_itl_ms"] = pred[k]
            row[f"measured_{k}_itl_ms"] = meas[k]
            row[f"{k}_itl_error_pct"] = 100 * (pred[k] - meas[k]) / meas[k] if meas[k] else None
        row["measured_p99_over_undisturbed"] = meas["p99"] / meas["undisturbed"]
        row["measured_max_over_undisturbed"] = meas["max"] / meas["undisturbed"]
        row["predicted_p99_over_undisturbed"] = pred["p99"] / pred["undisturbed"]
        row["predicted_max_over_undisturbed"] = pred["max"] / pred["undisturbed"]
        row["ttft_error_pct"] = (100 * (row["predicted_ttft_ms"] - row["measured_ttft_ms"]) / row["measured_ttft_ms"]
                                 if row["measured_ttft_ms"] else None)
        row["tpot_error_pct"] = row["undisturbed_itl_error_pct"]
        row["throughput_error_pct"] = None
        row["measured_gaps_ms"] = [round(g, 3) for g in gaps]
        rows.append(row)
        ctx.log(f"long prompt {length} {label} (budget {budget}): undisturbed {meas['undisturbed']:.1f} ms "
                f"(pred {quiet_pred:.1f}), p99 ITL {meas['p99']:.1f} (pred {pred['p99']:.1f}), "
                f"max {meas['max']:.1f} (pred {pred['max']:.1f})")
    return rows
