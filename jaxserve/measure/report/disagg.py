"""The report's disaggregated part (`jaxserve report --disagg P+D`): each pool's capacity, measured vs predicted.

A burst of same-length random prompts, all sent at once so both pools have work, is served by a prefill pool of
TP P and a decode pool of TP D, measured one of two ways:

- as separate server processes (`disagg_servers.py`, the mode on a CPU): one `jaxserve serve
  --disaggregation-mode prefill` and one `--disaggregation-mode decode` server, each pinned to cores of its own,
  their busy time and work read from their `/metrics`;
- in this process (`disagg_engine.py`, on an accelerator or with `--disagg-in-process`): the disaggregated engine,
  its pools on devices 0..P-1 and the next D (on a CPU, fake devices sharing the cores).

Either way a pool's busy time and work are counted per step (`jaxserve.engine.pool_stats`) and its capacity is
its work per busy second: the prefill pool's prompts/s, the decode pool's output tokens/s over `output_len - 1`
(the prefill pool draws the first token). The step budget is one prompt, so each prefill step is one whole
prompt, as the planner's prefill pool assumes. The planner's `pool_balance`, on the report's calibrated profile,
predicts both from the same step times its disaggregated plan uses, at the decode batch the pool actually ran (a
burst's batch ramps up and drains, so the prediction is asked about the measured mean). The balance is prefill
capacity / decode capacity; KV bytes per request are the measured mean against `kv_bytes_per_token * prompt_len`.
This module holds what both ways share: the flag, the rows, the summary and the markdown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import click

from jaxserve.engine.pool_stats import pool_rates
from jaxserve.measure.report.context import error_pct, fmt, fmt_pct
from planner.disaggregate import pool_balance

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


@dataclass
class PoolRun:
    """One measured burst, however it was served: each pool's counters (`POOL_COUNTERS`, the burst's deltas),
    the KV moved, and what the way of measuring adds (`checks`: per pool, each step against the step model;
    `config`: e.g. the servers' cores)."""

    mode: str  # "processes" or "engine"
    counters: dict[str, float]
    duration: float
    completed: int
    kv_transfers: int
    kv_bytes: float
    kv_seconds: float
    checks: dict[str, dict[str, Any]] | None = None
    cpu_seconds: dict[str, float] | None = None  # per pool: CPU seconds its server process used over the burst
    config: dict[str, Any] = field(default_factory=dict)


def pool_rows(ctx, run: PoolRun) -> list[dict[str, Any]]:
    """Rows of kind `disagg` for `run`: prefill and decode capacity, their balance, KV bytes per request, each
    against `pool_balance` on the report's profile."""
    cfg, log = ctx.cfg, ctx.log
    p, d = cfg.disagg
    n_in, n_out = cfg.disagg_input_len, cfg.disagg_output_len
    c, rates = run.counters, pool_rates(run.counters)
    batch = rates["decode_mean_batch"] or 1.0
    pred = pool_balance(ctx.spec, ctx.pool_hw or ctx.hw, n_in, n_out, prefill_tp=p, decode_tp=d,
                        decode_batch=max(1.0, batch), dtype=ctx.dtype)
    meas_p = rates["prefill_prompts_per_busy_s"]
    meas_d = rates["decode_tokens_per_busy_s"] / (n_out - 1) if rates["decode_tokens_per_busy_s"] else None
    busy = {pool: c[f"{pool}_busy_seconds"] for pool in ("prefill", "decode")}
    facts = ctx.facts
    config = {"pools": f"{p}+{d}", "prefill_devices": p, "decode_devices": d, "input_len": n_in,
              "output_len": n_out, "num_prompts": cfg.disagg_num_prompts, "max_num_seqs": cfg.disagg_max_num_seqs,
              "platform": facts.platform, "device_kind": facts.kind, "cpu": facts.cpu,
              "mode": run.mode, **run.config}
    pool_extra = {pool: {"steps": int(c[f"{pool}_steps"]), "busy_seconds": busy[pool],
                         "busy_fraction": busy[pool] / run.duration, "measured_step_ms": rates[f"{pool}_step_ms"],
                         **((run.checks or {}).get(pool) or {})} for pool in busy}
    if run.cpu_seconds:  # the same work per CPU second its process got: what other tenants of the cores took, out
        work = {"prefill": c["prefill_prompts"], "decode": c["decode_output_tokens"] / (n_out - 1)}
        for pool, x in pool_extra.items():
            cpu = run.cpu_seconds[pool]
            x.update(cpu_seconds=cpu, cpu_fraction=cpu / run.duration,
                     measured_per_cpu_second=work[pool] / cpu if cpu else None)
    measured = {"prefill_capacity": meas_p, "decode_capacity": meas_d,
                "balance": meas_p / meas_d if meas_p and meas_d else None,
                "kv_bytes_per_request": run.kv_bytes / run.kv_transfers if run.kv_transfers else None}
    predicted = {"prefill_capacity": pred.prefill_rps, "decode_capacity": pred.decode_rps,
                 "balance": pred.balance, "kv_bytes_per_request": pred.kv_bytes_per_request}
    for pool, x in pool_extra.items():
        if "measured_per_cpu_second" in x:
            x["per_cpu_second_error_pct"] = error_pct(predicted[f"{pool}_capacity"], x["measured_per_cpu_second"])
    extra = {"prefill_capacity": pool_extra["prefill"] | {"predicted_step_ms": 1e3 * pred.prefill_s},
             "decode_capacity": pool_extra["decode"] | {"predicted_step_ms": 1e3 * pred.decode_step_s,
                                                        "decode_batch": batch},
             "balance": {"predicted_balanced_pd": pred.balanced_pd,
                         "measured_balanced_pd": (meas_d / d) / (meas_p / p) if meas_p and meas_d else None},
             "kv_bytes_per_request": {"transfers": run.kv_transfers,
                                      "transfer_ms": 1e3 * run.kv_seconds / max(1, run.kv_transfers)}}
    rows = []
    for q, unit in QUANTITIES:
        rows.append({"kind": "disagg", "config": config | {"quantity": q}, "unit": unit,
                     "predicted": predicted[q], "measured": measured[q],
                     "error_pct": error_pct(predicted[q], measured[q]),
                     **extra[q], "completed": run.completed, "duration_s": run.duration,
                     "predicted_ttft_ms": None, "measured_ttft_ms": None, "predicted_tpot_ms": None,
                     "measured_tpot_ms": None, "predicted_throughput": None, "measured_throughput": None,
                     "ttft_error_pct": None, "tpot_error_pct": None, "throughput_error_pct": None})
        log(f"disagg {p}+{d} ({run.mode}) {q}: measured {fmt(measured[q], '.4g')} {unit} (pred "
            f"{fmt(predicted[q], '.4g')}, {fmt_pct(rows[-1]['error_pct'])})")
    for pool, x in pool_extra.items():
        log(f"disagg {p}+{d} {pool}: {x['steps']} steps, measured step {fmt(x['measured_step_ms'])} ms, busy "
            f"{_pct0(x['busy_fraction'])} of the run")
        if "cpu_seconds" in x:
            log(f"disagg {p}+{d} {pool} server: {fmt(x['cpu_seconds'], '.2f')} CPU s over the run "
                f"({_pct0(x['cpu_fraction'])}); capacity per CPU second {fmt(x['measured_per_cpu_second'], '.4g')} "
                f"req/s ({fmt_pct(x['per_cpu_second_error_pct'])})")
        if "overlap_fraction" in x:
            log(f"disagg {p}+{d} {pool} steps: {_pct0(x['overlap_fraction'])} of busy time beside the other pool; "
                f"measured / predicted step: alone {fmt(x['alone_over_predicted'], '.2f')} ({x['alone_steps']} "
                f"steps), beside the other pool {fmt(x['shared_over_predicted'], '.2f')} ({x['shared_steps']} steps)")
    log(f"disagg {p}+{d}: mean decode batch {batch:.1f}")
    return rows


def summarize_disagg(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Predicted, measured and error per quantity of the `disagg` rows (None without them)."""
    rows = [r for r in rows if r["kind"] == "disagg"]
    if not rows:
        return None
    out: dict[str, Any] = {"pools": rows[0]["config"]["pools"], "platform": rows[0]["config"]["platform"],
                           "mode": rows[0]["config"].get("mode", "engine")}
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
    processes = c.get("mode") == "processes"
    served = (f"two server processes (prefill on cores {c['prefill_cores']}, decode on cores {c['decode_cores']})"
              if processes else "the disaggregated engine in one process")
    lines = [f"## Disaggregated prefill/decode ({c['pools']}: prefill TP {c['prefill_devices']}, decode TP "
             f"{c['decode_devices']})", "",
             f"{c['num_prompts']} requests of {c['input_len']} prompt and {c['output_len']} output tokens, sent at "
             f"once to {served}; capacity = work per busy second of a pool; predicted by "
             f"`planner.disaggregate.pool_balance` at the measured mean decode batch ({dec['decode_batch']:.1f}).", "",
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
    if "overlap_fraction" in pre:
        lines += ["", "Each step against the step model on its own shape and padded bucket (median measured / "
                  "predicted), split by whether the other pool was busy for at least half of it:", "",
                  "| pool | busy beside the other pool | alone: steps | alone: meas / pred | beside: steps "
                  "| beside: meas / pred |", "|---|---|---|---|---|---|"]
        for name, r in (("prefill", pre), ("decode", dec)):
            lines.append(f"| {name} | {_pct0(r['overlap_fraction'])} | {r['alone_steps']} | "
                         f"{fmt(r['alone_over_predicted'], '.2f')} | {r['shared_steps']} | "
                         f"{fmt(r['shared_over_predicted'], '.2f')} |")
    if c.get("cpu") and not processes:
        lines += ["", "On CPU the pools are fake devices sharing the same cores, so a step that runs beside the other "
                  "pool's is slower than the single-device calibration it is predicted from. The planner assumes "
                  "separate devices: on CPU the measured capacities are expected below the predicted ones, and "
                  "the numbers above are not corrected for it."]
    if "cpu_seconds" in pre:
        lines += ["", "Per CPU second of each server process instead of per busy second (all its threads; what other "
                  "tenants of the cores took is left out): prefill "
                  f"{fmt(pre['measured_per_cpu_second'], '.3g')} req/s ({fmt_pct(pre['per_cpu_second_error_pct'])}, "
                  f"{fmt(pre['cpu_fraction'], '.2f')} CPU s per s of the run), decode "
                  f"{fmt(dec['measured_per_cpu_second'], '.3g')} req/s ({fmt_pct(dec['per_cpu_second_error_pct'])}, "
                  f"{fmt(dec['cpu_fraction'], '.2f')} CPU s per s)."]
    if processes:
        lines += ["", "Busy time is each server's engine steps (schedule to outputs), read from its `/metrics`; the "
                  "prefill server's steps include offering each prompt's KV, the decode server's exclude writing "
                  "the pulled KV into its pool (the KV move above). The client and the servers' HTTP and transfer "
                  "threads share the same cores. The prediction is for the cores the pools' profile was calibrated on: "
                  "without `--profile` the report calibrates one pinned to the prefill server's cores "
                  "(`pool-profile.json`); a `--profile` of more cores than a server has predicts it too fast."]
    return lines + [""]


def _pct0(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"
