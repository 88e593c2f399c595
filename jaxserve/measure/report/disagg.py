"""The report's disaggregated part (`jaxserve report --disagg P+D`): each pool's capacity, measured vs predicted.

A disaggregated engine (prefill pool on devices 0..P-1 with TP P, decode pool on the next D with TP D) serves a
burst of same-length random prompts, all sent at once so both pools have work. The engine counts each pool's
busy time and work (`jaxserve.engine.pool_stats`); a pool's capacity is its work per busy second: the prefill pool's
prompts/s, the decode pool's output tokens/s over `output_len - 1` (the prefill pool draws the first token).
The planner's `pool_balance`, on the report's calibrated profile, predicts both from the same step times its
disaggregated plan uses, at the decode batch the pool actually ran (a burst's batch ramps up and drains, so the
prediction is asked about the measured mean). The engine's step budget is one prompt, so each prefill step is
one whole prompt, as the planner's prefill pool assumes. The balance is prefill capacity / decode capacity;
KV bytes per request are the measured mean against `kv_bytes_per_token * prompt_len`.

On CPU the pools are fake devices on the same cores: while both compute, each is slower than calibrated alone.
So every step is also checked against the step model on its own shape, split by whether the other pool was busy
for at least half of it (`overlap_fractions`): that measures the slow-down. The capacities are not corrected.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from typing import Any

import click
import jax
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.disaggregated import DisaggregatedEngine
from jaxserve.engine.pool_stats import overlap_fractions, pool_rates
from jaxserve.measure.bench.datasets import DatasetConfig, generate
from jaxserve.measure.bench.load import LoadConfig, run_engine
from jaxserve.measure.report.context import error_pct, fmt, fmt_pct
from planner.disaggregate import pool_balance
from planner.step_model import StepShape, decode_shape, pad_tokens, prefill_shape, step_time_shape

QUANTITIES = (("prefill_capacity", "req/s"), ("decode_capacity", "req/s"), ("balance", "prefill/decode"),
              ("kv_bytes_per_request", "bytes"))


def parse_pools(text: str) -> tuple[int, int]:
    """'P+D' -> (P, D), both at least 1; ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*\+\s*(\d+)\s*", text)
    if not m:
        raise ValueError(f"--disagg takes P+D (prefill devices + decode devices, e.g. 1+1), got {text!r}")
    p, d = int(m.group(1)), int(m.group(2))
    if p < 1 or d < 1:
        raise ValueError(f"--disagg needs at least one device in each pool, got {text!r}")
    return p, d


def pools_option(ctx: Any, param: Any, value: str | None) -> tuple[int, int] | None:
    """click callback of `--disagg`: (P, D), or a one-line usage error."""
    try:
        return None if value is None else parse_pools(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def provide_devices(p: int, d: int) -> str:
    """Make P + D devices visible before JAX starts; returns the platform. ValueError if they cannot be.

    On CPU this asks JAX for P + D CPU devices (`jax_num_cpu_devices`, read only by the CPU platform, so it
    changes nothing on an accelerator; once JAX has started, the devices it has are used). Fake CPU devices
    beyond the cores would time-share them, which a speed measurement cannot use, so on CPU P + D must not
    exceed the cores this process may run on.
    """
    n = p + d
    with contextlib.suppress(RuntimeError):  # raised once the backend has started (e.g. in a test process)
        jax.config.update("jax_num_cpu_devices", max(n, jax.config.jax_num_cpu_devices))
    devices = jax.devices()
    if len(devices) < n:
        raise ValueError(f"--disagg {p}+{d} needs {n} devices; {len(devices)} visible")
    platform = devices[0].platform
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if platform == "cpu" and n > cores:
        raise ValueError(f"--disagg {p}+{d} needs {n} CPU devices but this machine has {cores} cores "
                         "(fake devices beyond the cores would only share them)")
    return platform


def engine_config(cfg, p: int, d: int, token_buckets: tuple[int, ...]):
    """The disaggregated engine: step budget one prompt, context prompt + output, the report engine's buckets
    below the prompt length (so decode batches are padded as in the rest of the report) and the prompt length."""
    n = cfg.disagg_input_len
    return EngineConfig(model=cfg.model, dtype=cfg.dtype, seed=cfg.seed, max_num_seqs=cfg.disagg_max_num_seqs,
                        max_num_batched_tokens=n, chunk_size=n, max_model_len=n + cfg.disagg_output_len,
                        kv_cache_memory=cfg.kv_cache_memory,
                        token_buckets=tuple(b for b in token_buckets if b < n) + (n,),
                        disaggregate=True, prefill_devices=p, decode_devices=d)



def run_disagg(ctx) -> list[dict[str, Any]]:
    """Rows of kind `disagg`: prefill and decode capacity, their balance, KV bytes per request."""
    cfg, log = ctx.cfg, ctx.log
    p, d = cfg.disagg
    n_in, n_out = cfg.disagg_input_len, cfg.disagg_output_len
    t0 = time.monotonic()
    engine = DisaggregatedEngine(engine_config(cfg, p, d, tuple(ctx.engine.runner.token_buckets)))
    log(f"disaggregated engine {p}+{d} ready in {time.monotonic() - t0:.0f} s")
    avoid = (ctx.spec.eos_token_id,) if ctx.spec.eos_token_id is not None else ()

    def burst(num: int, seed: int):
        reqs = generate(DatasetConfig(name="random", num_prompts=num, input_len=n_in, output_len=n_out, seed=seed),
                        ctx.spec.vocab_size, avoid)
        return run_engine(engine, reqs, LoadConfig(), salt=ctx.next_salt())

    burst(2, cfg.seed + 5)  # first-run effects (transfers, host paths) stay out of the measurement
    for steps in engine.pool_steps.values():
        steps.clear()
    run = burst(cfg.disagg_num_prompts, cfg.seed + 6)
    c, rates = run.counters, pool_rates(run.counters)
    batch = rates["decode_mean_batch"] or 1.0
    pred = pool_balance(ctx.spec, ctx.hw, n_in, n_out, prefill_tp=p, decode_tp=d, decode_batch=max(1.0, batch),
                        dtype=ctx.dtype)
    meas_p = rates["prefill_prompts_per_busy_s"]
    meas_d = rates["decode_tokens_per_busy_s"] / (n_out - 1) if rates["decode_tokens_per_busy_s"] else None
    busy = {pool: c[f"{pool}_busy_seconds"] for pool in ("prefill", "decode")}
    checks = {"prefill": _step_check(ctx, engine, "prefill", "decode", p),
              "decode": _step_check(ctx, engine, "decode", "prefill", d)}
    completed = sum(r.success for r in run.records)
    config = {"pools": f"{p}+{d}", "prefill_devices": p, "decode_devices": d, "input_len": n_in,
              "output_len": n_out, "num_prompts": cfg.disagg_num_prompts, "max_num_seqs": cfg.disagg_max_num_seqs,
              "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind}
    pool_extra = {pool: {"steps": c[f"{pool}_steps"], "busy_seconds": busy[pool],
                         "busy_fraction": busy[pool] / run.duration, "measured_step_ms": rates[f"{pool}_step_ms"],
                         **checks[pool]} for pool in busy}
    measured = {"prefill_capacity": meas_p, "decode_capacity": meas_d,
                "balance": meas_p / meas_d if meas_p and meas_d else None,
                "kv_bytes_per_request": c["kv_transfer_bytes"] / c["kv_transfers"] if c["kv_transfers"] else None}
    predicted = {"prefill_capacity": pred.prefill_rps, "decode_capacity": pred.decode_rps,
                 "balance": pred.balance, "kv_bytes_per_request": pred.kv_bytes_per_request}
    extra = {"prefill_capacity": pool_extra["prefill"] | {"predicted_step_ms": 1e3 * pred.prefill_s},
             "decode_capacity": pool_extra["decode"] | {"predicted_step_ms": 1e3 * pred.decode_step_s,
                                                        "decode_batch": batch},
             "balance": {"predicted_balanced_pd": pred.balanced_pd,
                         "measured_balanced_pd": (meas_d / d) / (meas_p / p) if meas_p and meas_d else None},
             "kv_bytes_per_request": {"transfers": c["kv_transfers"],
                                      "transfer_ms": 1e3 * c["kv_transfer_seconds"] / max(1, c["kv_transfers"])}}
    rows = []
    for q, unit in QUANTITIES:
        rows.append({"kind": "disagg", "config": config | {"quantity": q}, "unit": unit,
                     "predicted": predicted[q], "measured": measured[q],
                     "error_pct": error_pct(predicted[q], measured[q]),
                     **extra[q], "completed": completed, "duration_s": run.duration,
                     "predicted_ttft_ms": None, "measured_ttft_ms": None, "predicted_tpot_ms": None,
                     "measured_tpot_ms": None, "predicted_throughput": None, "measured_throughput": None,
                     "ttft_error_pct": None, "tpot_error_pct": None, "throughput_error_pct": None})
        log(f"disagg {p}+{d} {q}: measured {fmt(measured[q], '.4g')} {unit} (pred {fmt(predicted[q], '.4g')}, "
            f"{fmt_pct(rows[-1]['error_pct'])})")
    for pool, x in pool_extra.items():
        log(f"disagg {p}+{d} {pool} steps: {_pct0(x['overlap_fraction'])} of busy time beside the other pool; "
            f"measured / predicted step: alone {fmt(x['alone_over_predicted'], '.2f')} ({x['alone_steps']} steps), "
            f"beside the other pool {fmt(x['shared_over_predicted'], '.2f')} ({x['shared_steps']} steps)")
    log(f"disagg {p}+{d}: mean decode batch {batch:.1f}")
    return rows


def _step_check(ctx, engine, pool: str, other: str, tp: int) -> dict[str, Any]:
    """Each step of `pool` against the step model on its own shape and padded bucket, split by whether the
    other pool was busy for at least half of it: how much the pools slow each other down, measured."""
    steps = list(engine.pool_steps[pool])
    fractions = overlap_fractions(steps, list(engine.pool_steps[other]))
    buckets = (engine.prefill if pool == "prefill" else engine).runner.token_buckets
    groups: dict[str, list[float]] = {"alone": [], "shared": []}
    for s, f in zip(steps, fractions, strict=True):
        shape = StepShape()
        if s.num_decodes:  # the engine counts the new token in the context; decode_shape adds it
            shape = decode_shape(s.num_decodes, max(0.0, s.decode_context_tokens / s.num_decodes - 1))
        for q, done in s.prefill_chunks:
            shape = shape + prefill_shape(q, done)
        pred = step_time_shape(ctx.spec, ctx.hw, shape, tp=tp, dtype=ctx.dtype,
                               padded_tokens=pad_tokens(shape.num_tokens, buckets)).total_s
        groups["shared" if f >= 0.5 else "alone"].append((s.end - s.start) / pred)
    busy = sum(s.end - s.start for s in steps)
    both = sum(f * (s.end - s.start) for s, f in zip(steps, fractions, strict=True))
    out: dict[str, Any] = {"overlap_fraction": both / busy if busy else None}
    for k, ratios in groups.items():
        out[f"{k}_steps"] = len(ratios)
        out[f"{k}_over_predicted"] = float(np.median(ratios)) if ratios else None
    return out


def summarize_disagg(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Predicted, measured and error per quantity of the `disagg` rows (None without them)."""
    rows = [r for r in rows if r["kind"] == "disagg"]
    if not rows:
        return None
    out: dict[str, Any] = {"pools": rows[0]["config"]["pools"], "platform": rows[0]["config"]["platform"]}
    for r in rows:
        out[r["config"]["quantity"]] = {"predicted": r["predicted"], "measured": r["measured"],
                                        "error_pct": r["error_pct"]}
    return out


def markdown(report: dict[str, Any]) -> list[str]:
    """The report.md section of the `disagg` rows (empty without them)."""
    rows = {r["config"]["quantity"]: r for r in report["rows"] if r["kind"] == "disagg"}
    if not rows:
        return []
    c = rows["balance"]["config"]
    pre, dec, bal = rows["prefill_capacity"], rows["decode_capacity"], rows["balance"]
    lines = [f"## Disaggregated prefill/decode ({c['pools']}: prefill TP {c['prefill_devices']}, decode TP "
             f"{c['decode_devices']})", "",
             f"{c['num_prompts']} requests of {c['input_len']} prompt and {c['output_len']} output tokens, sent at "
             f"once; capacity = work per busy second of a pool; predicted by `planner.disaggregate.pool_balance` at "
             f"the measured mean decode batch ({dec['decode_batch']:.1f}).", "",
             "| quantity | unit | predicted | measured | error |", "|---|---|---|---|---|"]
    for q, unit in QUANTITIES:
        r = rows[q]
        spec = ".0f" if q == "kv_bytes_per_request" else ".3g"
        lines.append(f"| {q.replace('_', ' ')} | {unit} | {fmt(r['predicted'], spec)} | {fmt(r['measured'], spec)} | "
                     f"{fmt_pct(r['error_pct'])} |")
    lines += ["", f"Step times, predicted / measured: prefill {fmt(pre['predicted_step_ms'])} / "
              f"{fmt(pre['measured_step_ms'])} ms over {pre['steps']} steps, decode {fmt(dec['predicted_step_ms'])} / "
              f"{fmt(dec['measured_step_ms'])} ms over {dec['steps']} steps. Pools busy "
              f"{_pct0(pre['busy_fraction'])} (prefill) and {_pct0(dec['busy_fraction'])} (decode) of the "
              f"{pre['duration_s']:.2f} s run. Balanced split: {fmt(bal['predicted_balanced_pd'], '.2f')} prefill "
              f"devices per decode device predicted, {fmt(bal['measured_balanced_pd'], '.2f')} measured. KV move: "
              f"{fmt(rows['kv_bytes_per_request']['transfer_ms'], '.2f')} ms per request."]
    lines += ["", "Each step against the step model on its own shape and padded bucket (median measured / "
              "predicted), split by whether the other pool was busy for at least half of it:", "",
              "| pool | busy beside the other pool | alone: steps | alone: meas / pred | beside: steps "
              "| beside: meas / pred |", "|---|---|---|---|---|---|"]
    for name, r in (("prefill", pre), ("decode", dec)):
        lines.append(f"| {name} | {_pct0(r['overlap_fraction'])} | {r['alone_steps']} | "
                     f"{fmt(r['alone_over_predicted'], '.2f')} | {r['shared_steps']} | "
                     f"{fmt(r['shared_over_predicted'], '.2f')} |")
    if c["platform"] == "cpu":
        lines += ["", "On CPU the pools are fake devices sharing the same cores, so a step that runs beside the other "
                  "pool's is slower than the single-device calibration it is predicted from. The planner assumes "
                  "separate devices: on CPU the measured capacities are expected below the predicted ones, and "
                  "the numbers above are not corrected for it."]
    return lines + [""]




def _pct0(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"
