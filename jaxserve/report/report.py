"""`jaxserve report`: run the runtime, ask the planner about the same configuration, show the error.

On one engine: calibrate (or load `--profile`), a static grid (batch sizes x context lengths), two Poisson
loads at about 50% and 90% of the planner's predicted capacity, and the `long-prompt` workload with the
planner's chunk (ITL target 2x the undisturbed TPOT) and without chunking. Every point is predicted by the
planner on the calibrated profile: the grid by its discrete-event simulator (a static batch is a transient),
the loads by the simulator on the engine's own arrival trace (the closed form's steady state beside it), the
chunked runs by `chunked_prefill_itls`. With `--disagg P+D`, also a disaggregated engine's pool capacities
against `planner.disaggregate.pool_balance` (`report_disagg`). Writes DIR/report.json, DIR/report.md and
DIR/report.png (`report_render`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.bench.latency import measure_point
from jaxserve.bench.results import finite

Log = Callable[[str], None]


@dataclass
class ReportConfig:
    """Sizes of every part of the report; defaults take a few minutes for `small` on 2 CPU cores."""

    model: str = "small"
    dtype: str = "auto"
    seed: int = 0
    max_num_seqs: int = 32
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    context_lens: tuple[int, ...] = (128, 512)
    # 48 tokens: a one-request TPOT over 15 gaps (~0.3 s) moved by 15-25% between reports on this VM
    # (`reports/small-s69` to `-s71`), enough to carry the TPOT headline past its 10% limit on its own.
    grid_output_len: int = 48
    load_input_len: int = 128
    load_output_len: int = 32
    load_num_prompts: int = 48
    load_fractions: tuple[float, ...] = (0.5, 0.9)
    long_prompt_len: int = 4096
    long_decodes: int = 4
    long_decode_input: int = 64
    long_tail_tokens: int = 16
    kv_cache_memory: int | None = None  # bytes; None: the engine's default
    token_buckets: tuple[int, ...] | None = None  # None: `half_octave_ladder(budget)`; (): the engine's default
    calibration: Any = None  # a CalibrationConfig; None: the default (quick with --quick)
    quick: bool = False
    disagg: tuple[int, int] | None = None  # (prefill devices, decode devices): run the `report_disagg` part
    disagg_input_len: int = 128
    disagg_output_len: int = 32
    disagg_num_prompts: int = 48
    disagg_max_num_seqs: int = 16

    @classmethod
    def quick_config(cls, model: str = "tiny") -> ReportConfig:
        return cls(model=model, max_num_seqs=8, batch_sizes=(1, 4), context_lens=(16, 64), grid_output_len=4,
                   load_input_len=32, load_output_len=4, load_num_prompts=6, long_prompt_len=128, long_decodes=2,
                   long_decode_input=16, long_tail_tokens=4, disagg_input_len=32, disagg_output_len=4,
                   disagg_num_prompts=6, disagg_max_num_seqs=4, quick=True)

    @property
    def budget(self) -> int:
        """Step token budget: the whole long prompt and its decodes fit in one step (the unchunked run)."""
        return (self.long_prompt_len + self.long_decodes + 63) // 64 * 64

    def engine_config(self):
        from jaxserve.core.engine_config import EngineConfig
        from jaxserve.runner.model_runner import half_octave_ladder

        return EngineConfig(model=self.model, dtype=self.dtype, seed=self.seed, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.budget, chunk_size=self.budget,
                            kv_cache_memory=self.kv_cache_memory,
                            token_buckets=half_octave_ladder(self.budget) if self.token_buckets is None
                            else self.token_buckets)


@dataclass
class Context:
    """What every part needs: the engine, the model spec, the calibrated hardware and the planner dtype."""

    engine: Any
    spec: Any
    hw: Any
    dtype: str
    cfg: ReportConfig
    log: Log = print
    salt: int = 0

    def next_salt(self) -> str:
        self.salt += 1
        return f"report{self.cfg.seed}-{self.salt}"

    def serving_config(self, budget: int | None = None):
        from planner.serving import ServingConfig

        c = self.engine.config
        extra = {}
        if "token_buckets" in ServingConfig.__dataclass_fields__:  # once the planner models padding
            extra["token_buckets"] = tuple(self.engine.runner.token_buckets)
        return ServingConfig(max_num_seqs=c.max_num_seqs, chunk_size=budget or self.cfg.budget, page_size=c.page_size,
                             dtype=self.dtype, **extra)


def _err(pred: float | None, meas: float | None) -> float | None:
    if pred is None or meas is None or not meas or not math.isfinite(pred) or not math.isfinite(meas):
        return None
    return 100.0 * (pred - meas) / meas


def _row(kind: str, config: dict[str, Any], pred: dict[str, float | None], meas: dict[str, float | None],
         **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"kind": kind, "config": config}
    for k in ("ttft_ms", "tpot_ms", "throughput"):
        row[f"predicted_{k}"] = pred.get(k)
        row[f"measured_{k}"] = meas.get(k)
        row[f"{k.split('_')[0]}_error_pct"] = _err(pred.get(k), meas.get(k))
    row.update(extra)
    return row


# Grid ---------------------------------------------------------------------------------------------------------
def run_grid(ctx: Context) -> list[dict[str, Any]]:
    """Static batches: measured vs the planner's simulation of the same batch on the same scheduler budget."""
    from planner.serving import Workload
    from planner.simulate import simulate

    cfg = ctx.cfg
    measure_point(ctx.engine, 1, min(cfg.context_lens), 2, seed=cfg.seed + 999, salt=ctx.next_salt())
    rows = []
    for b in cfg.batch_sizes:
        for c in cfg.context_lens:
            p = measure_point(ctx.engine, b, c, cfg.grid_output_len, seed=cfg.seed + b * 7919 + c,
                              salt=ctx.next_salt())
            sim = simulate(ctx.spec, ctx.hw, Workload(input_len=c, output_len=cfg.grid_output_len, concurrency=b),
                           ctx.serving_config(), num_requests=b, warmup_fraction=0.0)
            step = _decode_step_ms(ctx, b, c + cfg.grid_output_len / 2)
            rows.append(_row("grid", {"batch_size": b, "context_len": c, "output_len": cfg.grid_output_len},
                             {"ttft_ms": sim.ttft.mean, "tpot_ms": sim.tpot.mean,
                              "throughput": sim.output_tokens_per_s},
                             {"ttft_ms": p.ttft_ms, "tpot_ms": p.tpot_ms, "throughput": p.output_throughput},
                             predicted_decode_step_ms=step, measured_decode_step_ms=p.decode_step_ms))
            ctx.log(f"grid {b:>3} x {c:>5}: TPOT {p.tpot_ms:7.2f} ms (pred {sim.tpot.mean:7.2f}), "
                    f"TTFT {p.ttft_ms:8.1f} ms (pred {sim.ttft.mean:8.1f})")
    return rows


def _decode_step_ms(ctx: Context, batch: int, context: float) -> float:
    from planner.step_model import decode_shape, step_time_shape

    return step_time_shape(ctx.spec, ctx.hw, decode_shape(batch, context), dtype=ctx.dtype).total_ms


def _avoid(ctx: Context) -> tuple[int, ...]:
    eos = ctx.spec.eos_token_id
    return (eos,) if eos is not None else ()


# Summary, orchestration, command ------------------------------------------------------------------------------
def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median absolute errors (%) over the grid and load rows, per metric and per kind, and the chunked targets."""

    def med(kinds: tuple[str, ...], key: str) -> float | None:
        errs = [abs(r[key]) for r in rows if r["kind"] in kinds and r.get(key) is not None]
        return float(np.median(errs)) if errs else None

    out: dict[str, Any] = {
        "median_abs_error_ttft_pct": med(("grid", "load"), "ttft_error_pct"),
        "median_abs_error_tpot_pct": med(("grid", "load"), "tpot_error_pct"),
        "median_abs_error_throughput_pct": med(("grid", "load"), "throughput_error_pct"),
        "grid": {"ttft": med(("grid",), "ttft_error_pct"), "tpot": med(("grid",), "tpot_error_pct")},
        "load": {"ttft": med(("load",), "ttft_error_pct"), "tpot": med(("load",), "tpot_error_pct")},
        "load_closed_form": {"ttft": med(("load",), "closed_form_ttft_error_pct"),
                             "tpot": med(("load",), "closed_form_tpot_error_pct")},
        "targets": {"tpot_pct": 10.0, "ttft_pct": 15.0, "chunked_p99_over_undisturbed": 2.0,
                    "unchunked_stall_over_undisturbed": 5.0, "chunked_prediction_pct": 20.0},
    }
    chunked = {r["config"]["mode"]: r for r in rows if r["kind"] == "chunked-prefill"}
    if "chunked" in chunked and "unchunked" in chunked:
        c, u = chunked["chunked"], chunked["unchunked"]
        out["chunked_prefill"] = {
            "chunk_step_budget": c["config"]["step_budget"],
            "measured_p99_over_undisturbed": c["measured_p99_over_undisturbed"],
            "predicted_p99_over_undisturbed": c["predicted_p99_over_undisturbed"],
            "measured_unchunked_max_over_undisturbed": u["measured_max_over_undisturbed"],
            "predicted_unchunked_max_over_undisturbed": u["predicted_max_over_undisturbed"],
            "chunked_p99_error_pct": c["p99_itl_error_pct"], "unchunked_max_error_pct": u["max_itl_error_pct"]}
    from jaxserve.report.disagg import summarize_disagg

    if (disagg := summarize_disagg(rows)) is not None:
        out["disagg"] = disagg
    t = out["targets"]
    out["met"] = {
        "tpot": out["median_abs_error_tpot_pct"] is not None and out["median_abs_error_tpot_pct"] <= t["tpot_pct"],
        "ttft": out["median_abs_error_ttft_pct"] is not None and out["median_abs_error_ttft_pct"] <= t["ttft_pct"]}
    if "chunked_prefill" in out:
        cp = out["chunked_prefill"]
        out["met"].update({
            "chunked_p99": cp["measured_p99_over_undisturbed"] <= t["chunked_p99_over_undisturbed"],
            "unchunked_stall": cp["measured_unchunked_max_over_undisturbed"] >= t["unchunked_stall_over_undisturbed"],
            "chunked_prediction": all(e is not None and abs(e) <= t["chunked_prediction_pct"]
                                      for e in (cp["chunked_p99_error_pct"], cp["unchunked_max_error_pct"]))})
    return out


def check_context(cfg: ReportConfig, max_model_len: int, page_size: int) -> None:
    """Raise ValueError, before calibrating or measuring anything, if a grid point, a load or the long prompt
    needs more context than the engine has (the run would otherwise lose its requests minutes in)."""
    from jaxserve.report.chunked import check_long_prompt_fits

    for what, tokens in ((f"the grid's {max(cfg.context_lens)}-token context", max(cfg.context_lens)
                          + cfg.grid_output_len), ("the loads' requests", cfg.load_input_len + cfg.load_output_len)):
        if tokens > max_model_len:
            raise ValueError(f"{what} and its outputs need {tokens} tokens but the model's max_model_len is "
                             f"{max_model_len}")
    check_long_prompt_fits(cfg, max_model_len, page_size)


def run_report(cfg: ReportConfig, out_dir: str | Path, profile: str | None = None, log: Log = print) -> dict[str, Any]:
    """Build the engine, calibrate (or load `profile`), run every part, write json/md/png into `out_dir`."""
    from jaxserve.calibrate.calibrate import CalibrationConfig, calibrate, planner_dtype
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.report.chunked import run_chunked
    from jaxserve.report.disagg import run_disagg
    from jaxserve.report.loads import run_loads
    from jaxserve.report.probe import drift, drift_note, probe
    from jaxserve.report.render import write_markdown, write_plot
    from planner.hardware import load_hardware

    t0 = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engine = LLMEngine(cfg.engine_config())
    check_context(cfg, engine.max_model_len, engine.config.page_size)
    log(f"engine ready in {time.monotonic() - t0:.0f} s (budget {cfg.budget} tokens, buckets "
        f"{engine.runner.token_buckets})")
    calibration = None
    if profile:
        from jaxserve.calibrate.steps import PromptSource, warm_engine

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
    ctx = Context(engine=engine, spec=engine.spec, hw=hw, dtype=planner_dtype(engine.dtype), cfg=cfg, log=log)
    rows: list[dict[str, Any]] = []
    probes = [probe(ctx, "before the grid")]
    parts = [("grid", run_grid), ("loads", run_loads), ("chunked prefill", run_chunked)]
    for name, part in parts + ([("disaggregated pools", run_disagg)] if cfg.disagg else []):
        rows += part(ctx)
        probes.append(probe(ctx, f"after the {name}"))
        (out / "report.partial.json").write_text(json.dumps(finite({"rows": rows}), indent=2) + "\n")
    (out / "report.partial.json").unlink()
    summary = summarize(rows)
    summary["machine_drift"] = drift(probes)
    summary["machine_steady"] = drift_note(summary["machine_drift"]) is None
    report = {"model": cfg.model, "dtype": ctx.dtype, "hardware": hw.name, "profile": profile,
              "coefficients": hw.coefficients.to_dict(), "calibration": calibration,
              "engine": {"max_num_seqs": engine.config.max_num_seqs, "step_budget": cfg.budget,
                         "page_size": engine.config.page_size, "token_buckets": list(engine.runner.token_buckets)},
              "config": asdict(cfg), "rows": rows, "summary": summary, "reference_steps": probes,
              "seconds": time.monotonic() - t0, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    report = finite(report)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, out / "report.md")
    write_plot(report, out / "report.png")
    return report


def _command():
    import click

    from jaxserve.report.disagg import pools_option

    @click.command("report")
    @click.option("--model", default="small", show_default=True, help="Preset or HF checkpoint folder.")
    @click.option("--dtype", default="auto", show_default=True,
                  type=click.Choice(["auto", "float32", "bfloat16", "float16"]))
    @click.option("--profile", default=None, type=click.Path(exists=True, dir_okay=False),
                  help="A calibrated hardware profile (default: calibrate now, into DIR/profile.json).")
    @click.option("--out", "out_dir", default="reports/report", show_default=True, type=click.Path(file_okay=False))
    @click.option("--quick", is_flag=True, help="Tiny sizes everywhere (tests, smoke runs).")
    @click.option("--seed", default=0, show_default=True, type=int)
    @click.option("--batch-sizes", default=None, help="Grid batch sizes, comma-separated.")
    @click.option("--context-lens", default=None, help="Grid context lengths, comma-separated.")
    @click.option("--long-prompt-len", default=None, type=click.IntRange(min=16))
    @click.option("--load-num-prompts", default=None, type=click.IntRange(min=2))
    @click.option("--disagg", default=None, metavar="P+D", callback=pools_option,
                  help="Also serve a burst on P prefill + D decode devices (on CPU: P + D fake devices, at most "
                       "the cores) and compare each pool's capacity with the planner's.")
    def report_command(model: str, dtype: str, profile: str | None, out_dir: str, quick: bool, seed: int,
                       batch_sizes: str | None, context_lens: str | None, long_prompt_len: int | None,
                       load_num_prompts: int | None, disagg: tuple[int, int] | None) -> None:
        """Measured vs predicted: calibrate, grid, two loads, chunked prefill (+ --disagg); DIR/report.*."""
        if disagg:  # before anything starts JAX: on CPU the devices are created with the backend
            from jaxserve.report.disagg import provide_devices

            try:
                provide_devices(*disagg)
            except ValueError as e:
                raise click.UsageError(str(e)) from None
        from jaxserve.output_paths import check_writable

        check_writable(out_dir, is_dir=True)
        cfg = ReportConfig.quick_config(model) if quick else ReportConfig(model=model)
        cfg = replace(cfg, dtype=dtype, seed=seed, disagg=disagg)
        try:
            if batch_sizes:
                cfg = replace(cfg, batch_sizes=tuple(int(v) for v in batch_sizes.split(",")))
                cfg = replace(cfg, max_num_seqs=max(cfg.max_num_seqs, *cfg.batch_sizes))
            if context_lens:
                cfg = replace(cfg, context_lens=tuple(int(v) for v in context_lens.split(",")))
        except ValueError:
            raise click.UsageError("--batch-sizes and --context-lens take comma-separated integers") from None
        if long_prompt_len:
            cfg = replace(cfg, long_prompt_len=long_prompt_len)
        if load_num_prompts:
            cfg = replace(cfg, load_num_prompts=load_num_prompts)
        try:
            report = run_report(cfg, out_dir, profile, log=lambda m: click.echo(m, err=True))
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        s = report["summary"]
        click.echo(Path(out_dir, "report.md").read_text())
        click.echo(f"median |error|: TTFT {_fmt(s['median_abs_error_ttft_pct'])}%, "
                   f"TPOT {_fmt(s['median_abs_error_tpot_pct'])}% "
                   f"-> {out_dir}/report.json, report.md, report.png ({report['seconds']:.0f} s)")

    return report_command


report_command = _command()


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
