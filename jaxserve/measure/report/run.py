"""`jaxserve report`: run the runtime, ask the planner about the same configuration, show the error.

On one engine: calibrate (or load `--profile`), a static grid (batch sizes x context lengths), two Poisson
loads at about 50% and 90% of the planner's predicted capacity, and the `long-prompt` workload with the
planner's chunk (ITL target 2x the undisturbed TPOT) and without chunking. Every point is predicted by the
planner on the calibrated profile: the grid by its discrete-event simulator (a static batch is a transient),
the loads by the simulator on the engine's own arrival trace (the closed form's steady state beside it), the
chunked runs by `chunked_prefill_itls`. With `--disagg P+D`, also the pool capacities of a prefill and a
decode server in separate processes (on a CPU; `--disagg-in-process` or an accelerator: the disaggregated engine
in this process) against `planner.disaggregate.pool_balance` (`jaxserve.measure.report.disagg`); with
`--disagg-only`, that part alone. Writes DIR/report.json, DIR/report.md and DIR/report.png
(`jaxserve.measure.report.render`; no PNG without grid rows).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.measure.bench.results import finite
from jaxserve.measure.calibrate.calibrate import CalibrationConfig, calibrate, planner_dtypes
from jaxserve.measure.calibrate.steps import PromptSource, warm_engine
from jaxserve.measure.report.chunked import run_chunked
from jaxserve.measure.report.context import Context, Log, ReportConfig
from jaxserve.measure.report.disagg_engine import run_disagg_engine
from jaxserve.measure.report.disagg_servers import calibrate_pinned, run_disagg_servers
from jaxserve.measure.report.grid import run_grid
from jaxserve.measure.report.loads import run_loads
from jaxserve.measure.report.probe import drift, drift_note, probe
from jaxserve.measure.report.render import write_markdown, write_plot
from jaxserve.measure.report.speculative import run_speculative
from jaxserve.measure.report.summary import check_context, summarize
from planner.hardware import load_hardware


def run_report(cfg: ReportConfig, out_dir: str | Path, profile: str | None = None, log: Log = print) -> dict[str, Any]:
    """Build the engine, calibrate (or load `profile`), run every part, write json/md/png into `out_dir`."""
    t0 = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engine = LLMEngine(cfg.engine_config())
    check_context(cfg, engine.max_model_len, engine.config.page_size)
    log(f"engine ready in {time.monotonic() - t0:.0f} s (budget {cfg.budget} tokens, buckets "
        f"{engine.runner.token_buckets})")
    calibration = None
    dtype, kv_dtype = planner_dtypes(engine)
    processes = bool(cfg.disagg) and engine.policy.pools_as_pinned_processes and not cfg.disagg_in_process
    pool_profile = None
    if processes and not profile:  # the pools' servers run on P cores each: price them from a profile of P cores
        cores = engine.policy.facts.cores[:cfg.disagg[0]]
        pool_profile = str(calibrate_pinned(cfg, cores, out / "pool-profile.json", log))
        profile = pool_profile if cfg.disagg_only else None  # that part alone: no calibration on every core
    if profile:
        check_profile_dtypes(profile, dtype, kv_dtype)
        hw = load_hardware(profile)
        warm_engine(engine, PromptSource(engine, cfg.seed + 1))
    else:
        ccfg = cfg.calibration or (CalibrationConfig.quick() if cfg.quick else CalibrationConfig())
        cal = calibrate(engine, ccfg, lambda phase, frac: log(f"calibrate: {phase}") if frac < 1 else None,
                        seed=cfg.seed)
        cal.save(out / "profile.json")
        hw = cal.hardware
        calibration = {"seconds": cal.seconds, "median_abs_error": cal.fit.median_abs_error,
                       "max_abs_error": cal.fit.max_abs_error, "samples": len(cal.samples),
                       "profile": str(out / "profile.json")}
        log(f"calibrated in {cal.seconds:.0f} s: step fit median |error| {cal.fit.median_abs_error:.1%}")
        # As after loading a profile: the first steps after the fit's seconds of host work ran slow (docs/tuning.md).
        warm_engine(engine, PromptSource(engine, cfg.seed + 1))
    ctx = Context(engine=engine, spec=engine.spec, hw=hw, dtype=dtype, kv_dtype=kv_dtype, cfg=cfg, log=log,
                  pool_hw=load_hardware(pool_profile) if pool_profile else None)
    rows: list[dict[str, Any]] = []
    probes = [probe(ctx, "before the grid")]
    parts = [] if cfg.disagg_only else [("grid", run_grid), ("loads", run_loads), ("chunked prefill", run_chunked)]
    parts += [("disaggregated pools", run_disagg_servers if processes else run_disagg_engine)] if cfg.disagg else []
    parts += [("speculative decoding", run_speculative)] if cfg.speculative else []
    for name, part in parts:
        rows += part(ctx)
        probes.append(probe(ctx, f"after the {name}"))
        (out / "report.partial.json").write_text(json.dumps(finite({"rows": rows}), indent=2) + "\n")
    (out / "report.partial.json").unlink()
    summary = summarize(rows)
    summary["machine_drift"] = drift(probes)
    summary["machine_steady"] = drift_note(summary["machine_drift"]) is None
    report = {"model": cfg.model, "dtype": ctx.dtype, "kv_dtype": ctx.kv_dtype, "hardware": hw.name, "profile": profile,
              "pool_profile": pool_profile, "coefficients": hw.coefficients.to_dict(), "calibration": calibration,
              "engine": {"max_num_seqs": engine.config.max_num_seqs, "step_budget": cfg.budget,
                         "page_size": engine.config.page_size, "token_buckets": list(engine.runner.token_buckets),
                         "attention_backend": engine.runner.ops.attention.name,
                         "cpu_kernels": (engine.runner.ops.matmul.plan.describe() if engine.runner.ops.matmul.plan
                                         else None)},
              "config": asdict(cfg), "rows": rows, "summary": summary, "reference_steps": probes,
              "seconds": time.monotonic() - t0, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    report = finite(report)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, out / "report.md")
    if any(r["kind"] == "grid" for r in rows):
        write_plot(report, out / "report.png")
    return report


def check_profile_dtypes(profile: str, dtype: str, kv_dtype: str) -> None:
    """ValueError when `profile` was calibrated on weights or KV of other dtypes than the engine's (an int8 engine
    reads its weights at another rate than a float one: `calibrate.planner_dtypes`); profiles that name none pass."""
    measured = json.loads(Path(profile).read_text()).get("measurements", {})
    for name, ours, theirs in (("weights", dtype, measured.get("dtype")), ("KV", kv_dtype, measured.get("kv_dtype"))):
        if theirs is not None and theirs != ours:
            raise ValueError(f"{profile} was calibrated with {name} in {theirs}; this engine's are {ours} "
                             "(calibrate with the same --quantization and --kv-cache-dtype)")
