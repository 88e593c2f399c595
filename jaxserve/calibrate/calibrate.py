"""`jaxserve calibrate`: measure the local JAX device and the engine, fit the planner's coefficients.

Measures streaming bandwidth, dense matmul peak, GEMM throughput across M at the model's MLP shape, and real
engine steps: lone prefills, decode batches over sequences x context (the attention cost), and decodes with a
chunked long prompt beside them (mixed steps). The step times are fitted with `calibrate_fit` to the planner's
additive model; the result is a hardware profile JSON for `jaxserve plan --hardware profile.json`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.calibrate.steps import (
    PromptSource,
    StepSample,
    measure_decode,
    measure_mixed,
    measure_prefill,
    step_budget,
    warm_engine,
)
from jaxserve.model.attention.paged_attention import smallest_chunk
from planner.calibration import Sample, fit_coefficients
from planner.hardware import CATALOG, GIGA, Hardware
from planner.step_model import step_time_shape

Progress = Callable[[str, float], None]  # (phase description, fraction of the whole done)


@dataclass
class CalibrationConfig:
    """Sizes of the measurements; `quick()` is for tests."""

    # 2048 and 3072: long lone prefills, so the fit sees attention's cost apart from the chunked (mixed) steps'.
    # With 2048 alone, the report's 4096-token prompt came out 5-22% slow (`reports/small-s61` to `-s77`): the
    # CPU kernel's tiles of a long prompt run at a better rate than the many mixed steps' shorter chunks.
    prefill_lens: tuple[int, ...] = (16, 64, 256, 512, 2048, 3072)
    # Nine decode points of ten steps each: with five points of six steps, one noisy decode step moved the
    # report's TPOT headline by several percent.
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    decode_contexts: tuple[int, ...] = (64, 512)
    decode_steps: int = 10
    # Every decode point is measured in this many rounds over all of them, each a sample of its own: this VM's
    # speed moves by 10-20% within seconds, and with one round, neighbouring points of one calibration differed
    # by that much (`reports/small-s69`: one decode 19.3 ms at 70 tokens of context, 27.1 at 518), which moved the
    # report's TPOT headline past its 10% limit.
    decode_rounds: int = 3
    max_decode_prompt_tokens: int = 4096  # skip decode points whose prompts (batch x context) cost more
    mixed_decodes: int = 4
    mixed_prompt_len: int = 1024
    mixed_chunk: int = 256  # step token budget while the long prompt is chunked (page multiple)
    # Then small chunks over a longer prompt, one page at a time and, where the runtime has smaller query blocks
    # (a CPU), as many tokens as the smallest: what a small chunk over a long history costs beyond its FLOPs
    # (the `attn_m_half` coefficient; the sub-page chunks the planner picks for a tight ITL target on a CPU cost
    # mostly that); every k-th of each run's steps, `mixed_small_samples` of each.
    mixed_small_chunks: tuple[int, ...] | None = None  # None: a page and this backend's smallest query block
    mixed_small_prompt_len: int = 2048
    mixed_small_samples: int = 8
    gemm_rows: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)
    bandwidth_bytes: int = 256 * 2**20
    matmul_n: int = 1024
    repeats: int = 2

    @classmethod
    def quick(cls) -> CalibrationConfig:
        return cls(prefill_lens=(16, 32), decode_batches=(1, 4), decode_contexts=(16, 64), decode_steps=3,
                   decode_rounds=1, mixed_decodes=2, mixed_prompt_len=96, mixed_chunk=32, mixed_small_prompt_len=64,
                   mixed_small_samples=2, gemm_rows=(1, 16, 64),
                   bandwidth_bytes=16 * 2**20, matmul_n=256, repeats=1)


@dataclass
class FitResult:
    """How well the fitted coefficients explain the measured steps."""

    median_abs_error: float
    max_abs_error: float
    errors: list[float] = field(default_factory=list)  # predicted / measured - 1, per sample
    fixed: dict[str, float] = field(default_factory=dict)  # coefficients measured directly, not fitted


@dataclass
class Calibration:
    """The fitted hardware, the fit's quality, and every raw measurement."""

    hardware: Hardware
    fit: FitResult
    dtype: str  # planner dtype name of the measured engine: fp32 | bf16 | fp16
    samples: list[StepSample] = field(default_factory=list)
    measurements: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def profile(self) -> dict[str, Any]:
        """The profile JSON object (loadable by planner.hardware.load_hardware)."""
        d = self.hardware.to_profile()
        d["device"] = self.measurements.get("device", "")
        d["notes"] = (f"jaxserve calibrate on {self.measurements.get('model')} in {self.dtype}: "
                      f"step-time fit median |error| {self.fit.median_abs_error:.1%}, max {self.fit.max_abs_error:.1%} "
                      f"over {len(self.samples)} engine steps; per-layer overhead folded into step_overhead_s")
        d["measurements"] = self.measurements
        return d

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.profile(), indent=2) + "\n")


def planner_dtype(dtype: Any) -> str:
    """jnp dtype -> planner dtype name."""
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[str(np.dtype(dtype))]


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compile
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Streaming read bandwidth (bytes/s): a jitted sum over a float32 array of `nbytes`."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(nbytes // 4, jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    return nbytes / _best_time(lambda: f(x), repeats)


def measure_matmul(n: int, dtype: Any, repeats: int = 3) -> float:
    """Dense square-GEMM throughput (FLOP/s) in `dtype`."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / _best_time(lambda: f(a, b), repeats)


def measure_gemm_rows(rows: tuple[int, ...], k: int, n: int, dtype: Any, repeats: int = 3,
                      cpu_kernel: bool = False) -> list[dict[str, float]]:
    """Time of x[M, k] @ W[k, n] per M (the model's fused gate/up shape) as the model runs it (`linear`, which
    picks the CPU matmul by M; `cpu_kernel`: the engine's, whether it may use jaxserve's): achieved FLOP/s and
    bytes/s."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model.llama import linear

    w = jnp.ones((k, n), dtype)
    f = jax.jit(lambda x, w: linear(x, w, cpu_kernel))
    out = []
    for m in rows:
        x = jnp.ones((m, k), dtype)
        t = _best_time(lambda x=x: f(x, w), repeats)
        nbytes = (k * n + m * k + m * n) * np.dtype(dtype).itemsize
        out.append({"rows": m, "seconds": t, "gflops": 2 * m * k * n / t / GIGA, "gbps": nbytes / t / GIGA})
    return out


def measure_weight_streams(weights: list[Any], rows: tuple[int, ...] = (1, 2), repeats: int = 50,
                           cpu_kernel: bool = False) -> dict[int, float]:
    """Weight bytes/s of each `rows` count of tokens through `weights` ([in, ...] arrays, together more than a
    cache holds), as the model runs them (`linear`, with `cpu_kernel` as the engine has it): a decode's weight
    streaming. The row counts alternate and each keeps its median, so their ratio compares the two kernels in the
    same state of the machine. Fifty repeats: a throwaway driver calling this four times on `small`'s shapes read
    ratios of 1.22-1.29 with 50, 1.21-1.61 with 15."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model.llama import linear

    f = jax.jit(lambda x, ws: sum(linear(x, w, cpu_kernel).sum() for w in ws))
    k = weights[0].shape[0]
    xs = {r: jnp.ones((r, k), weights[0].dtype) for r in rows}
    times: dict[int, list[float]] = {r: [] for r in rows}
    for r in rows:
        jax.block_until_ready(f(xs[r], weights))  # compile
    for _ in range(repeats):
        for r in rows:
            t0 = time.perf_counter()
            jax.block_until_ready(f(xs[r], weights))
            times[r].append(time.perf_counter() - t0)
    nbytes = sum(w.size * w.dtype.itemsize for w in weights)
    return {r: nbytes / float(np.median(times[r])) for r in rows}


def engine_mlp_weights(engine) -> list[Any]:
    """The engine's own fused gate/up weights ([hidden, 2, intermediate], one per layer), or fresh arrays of that
    shape when the model has none: the rate is measured on the memory a decode step reads. On this VM one row
    streamed at 43-49 GB/s in most calibrations and at 58-71 in a third of them, fresh arrays or the engine's
    own (`reports/small-s42`), while the engine's one-request TPOT stayed at 12-13 ms; the cause is not known."""
    import jax.numpy as jnp

    spec = engine.spec
    shape = (spec.hidden_size, 2, spec.intermediate_size)
    own = [w for w in engine.runner.param_leaves if tuple(w.shape) == shape]
    if len(own) == spec.num_layers:
        return own
    return [jnp.full(shape, 1e-3 * (i + 1), engine.dtype) for i in range(spec.num_layers)]


# The profile ------------------------------------------------------------------------------------------------------
def local_hardware(memory_bw: float, peak: float, dtype: str) -> tuple[Hardware, str]:
    """A `Hardware` for the local device with measured peak and bandwidth; links from the catalog if known."""
    import jax

    dev = jax.devices()[0]
    kind = str(getattr(dev, "device_kind", dev.platform))
    base = CATALOG["cpu"]
    for name, hw in CATALOG.items():
        if name != "cpu" and name.split("-")[0] in kind.lower().replace(" ", ""):
            base = hw
    if dev.platform == "cpu":
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    else:
        memory = float((dev.memory_stats() or {}).get("bytes_limit", base.memory_bytes))
    peaks = {dtype: peak}
    if dtype in ("bf16", "fp16"):
        peaks = {"bf16": peak, "fp16": peak}
    sources = {"compute": f"measured by jaxserve calibrate: {dtype} square GEMM on {kind}",
               "memory": f"measured by jaxserve calibrate: jitted streaming sum on {kind}; capacity from the device",
               "intra_node": f"from catalog entry {base.name!r}", "allreduce_latency": f"from catalog {base.name!r}",
               "inter_node": f"from catalog {base.name!r}"}
    hw = Hardware(name=f"calibrated-{dev.platform}", peak_flops=peaks, memory_bytes=memory, memory_bw=memory_bw,
                  intra_node_bw=base.intra_node_bw, allreduce_latency_s=base.allreduce_latency_s,
                  inter_node_bw=base.inter_node_bw, devices_per_node=max(1, jax.local_device_count()),
                  sources=sources, coefficients=base.coefficients)
    return hw, f"{dev.platform}: {kind} x{jax.local_device_count()}"


def calibrate(engine, cfg: CalibrationConfig | None = None, progress: Progress | None = None,
              seed: int = 0) -> Calibration:
    """Measure the device and `engine` (an LLMEngine, warmed up), fit the coefficients."""
    cfg = cfg or CalibrationConfig()
    say = progress or (lambda phase, frac: None)
    t0 = time.monotonic()
    dtype = planner_dtype(engine.dtype)
    spec = engine.spec
    say("memory bandwidth", 0.0)
    bw = measure_bandwidth(cfg.bandwidth_bytes)
    say("matmul peak", 0.05)
    peak = measure_matmul(cfg.matmul_n, engine.dtype)
    say("GEMM rows", 0.1)
    gemm = measure_gemm_rows(cfg.gemm_rows, spec.hidden_size, 2 * spec.intermediate_size, engine.dtype,
                             cpu_kernel=engine.runner.cpu_kernels)
    hw, device = local_hardware(bw, peak, dtype)
    ids = PromptSource(engine, seed)
    budget = min(engine.config.max_num_batched_tokens, engine.config.chunk_size)
    samples: list[StepSample] = []
    say("engine warm-up", 0.12)
    warm_engine(engine, ids)
    say("engine prefill steps", 0.15)
    samples += measure_prefill(engine, ids, tuple(n for n in cfg.prefill_lens
                                                  if n <= budget and n < engine.max_model_len), cfg.repeats)
    points = [(b, c) for c in cfg.decode_contexts for b in cfg.decode_batches
              if b <= engine.config.max_num_seqs and b * c <= cfg.max_decode_prompt_tokens]
    rounds = [(r, b, c) for r in range(cfg.decode_rounds) for b, c in points]
    for k, (r, b, c) in enumerate(rounds):
        say(f"engine decode steps: {b} seqs x {c} context (round {r + 1} of {cfg.decode_rounds})",
            0.3 + 0.5 * k / len(rounds))
        samples += measure_decode(engine, ids, b, c, cfg.decode_steps)
    say("engine mixed steps (chunked prefill beside decodes)", 0.8)
    prompt = min(cfg.mixed_prompt_len, engine.max_model_len - 1)
    decodes = min(cfg.mixed_decodes, engine.config.max_num_seqs - 1)
    with step_budget(engine, cfg.mixed_chunk):
        samples += measure_mixed(engine, ids, decodes, prompt)
    page = engine.config.page_size
    chunks = cfg.mixed_small_chunks or tuple(sorted({page, smallest_chunk(page)}, reverse=True))
    for chunk in chunks:
        say(f"engine mixed steps: {chunk}-token chunks over a long prompt", 0.88)
        prompt = min(cfg.mixed_small_prompt_len, engine.max_model_len - 1)
        with step_budget(engine, engine.config.max_num_batched_tokens, chunk=chunk):
            small = measure_mixed(engine, ids, decodes, prompt)
        every = max(1, len(small) // cfg.mixed_small_samples)
        samples += small[every - 1::every]  # ends at (or near) the longest history
    say("fitting", 0.95)
    # With one model the weight term barely varies between steps, so it is measured: two rows through every
    # layer's widest weight, the engine's own; their bandwidth over the stream's is weight_bw_eff. One row runs
    # another kernel on a CPU (XLA's GEMV), whose rate the fit takes from the engine's one-decode steps
    # (gemv_speedup): measured apart, its stream read 58-71 GB/s in a third of calibrations against 43-49 in
    # the rest while the engine's one-row steps did not move. The one-row stream is kept as a measurement.
    streams = measure_weight_streams(engine_mlp_weights(engine), cpu_kernel=engine.runner.cpu_kernels)
    stream, stream_rows = streams[1], streams[2]
    fixed = {"weight_bw_eff": float(np.clip(stream_rows / bw, 0.01, 1.5))}
    coefficients, _ = fit_coefficients(spec, hw, [Sample(s.shape, s.seconds) for s in samples], dtype=dtype,
                                       fixed=fixed)
    hw = hw.with_coefficients(**coefficients.to_dict())
    errors = [step_time_shape(spec, hw, s.shape, dtype=dtype).total_s / s.seconds - 1 for s in samples]
    fit = FitResult(median_abs_error=float(np.median(np.abs(errors))), max_abs_error=float(np.max(np.abs(errors))),
                    errors=errors, fixed=fixed)
    attention = _attention_slopes(samples)
    measurements = {
        "device": device, "model": spec.name, "dtype": dtype, "memory_bandwidth_gbps": bw / GIGA,
        "matmul_tflops": peak / 1e12, "matmul_n": cfg.matmul_n, "gemm_rows": gemm, "fixed_coefficients": fixed,
        "weight_stream_gbps": stream / GIGA, "weight_stream_2_rows_gbps": stream_rows / GIGA,
        "attention_us_per_seq_token": attention,
        "engine": {"max_num_seqs": engine.config.max_num_seqs,
                   "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                   "chunk_size": engine.config.chunk_size, "page_size": engine.config.page_size},
        "steps": [{"kind": s.kind, "num_decode": s.shape.num_decode, "prefill_tokens": s.shape.prefill_tokens,
                   "decode_context": s.shape.decode_context, "ms": s.seconds * 1e3, "fit_error": e}
                  for s, e in zip(samples, fit.errors, strict=True)],
    }
    say("done", 1.0)
    return Calibration(hardware=hw, fit=fit, dtype=dtype, samples=samples, measurements=measurements,
                       seconds=time.monotonic() - t0)


def _attention_slopes(samples: list[StepSample]) -> dict[str, float]:
    """Decode-step cost per (sequence x context token), in us, per batch size: the slope over context."""
    out: dict[str, float] = {}
    by_batch: dict[int, list[StepSample]] = {}
    for s in samples:
        if s.kind == "decode":
            by_batch.setdefault(s.shape.num_decode, []).append(s)
    for b, ss in by_batch.items():
        x = np.array([s.shape.decode_context for s in ss])
        if np.ptp(x) > 0:
            slope = np.polyfit(x, [s.seconds for s in ss], 1)[0]
            out[str(b)] = float(slope * 1e6)
    return out


def summary_rows(cal: Calibration) -> list[tuple[str, str]]:
    """(name, value) lines for the terminal."""
    hw, c = cal.hardware, cal.hardware.coefficients
    rows = [("device", cal.measurements["device"]),
            ("memory bandwidth", f"{hw.memory_bw / GIGA:.1f} GB/s"),
            (f"matmul peak ({cal.dtype})", f"{hw.peak(cal.dtype) / GIGA:.1f} GFLOP/s"),
            ("step-time fit", f"median |err| {cal.fit.median_abs_error:.1%}, max {cal.fit.max_abs_error:.1%} "
                              f"({len(cal.samples)} steps)")]
    rows += [(k, f"{v:.4g}") for k, v in asdict(c).items()]
    rows.append(("took", f"{cal.seconds:.0f} s"))
    return rows


def run_with_progress(engine, cfg: CalibrationConfig, seed: int = 0) -> Calibration:
    """`calibrate` under a rich progress bar."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description:<55}"), BarColumn(), TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("calibrating", total=1.0)
        return calibrate(engine, cfg, lambda phase, frac: bar.update(task, description=phase, completed=frac),
                         seed=seed)


def _command():
    import click

    from jaxserve.engine.args import config_from_options, engine_options

    @click.command("calibrate")
    @engine_options
    @click.option("--out", default="profile.json", show_default=True, type=click.Path(dir_okay=False),
                  help="Where to write the hardware profile JSON.")
    @click.option("--quick", is_flag=True, help="Tiny measurement sizes (tests, smoke runs).")
    def calibrate_command(out: str, quick: bool, **options) -> None:
        """Measure this device and the engine; write a hardware profile for `jaxserve plan --hardware`."""
        from rich.console import Console
        from rich.table import Table

        from jaxserve.engine.llm_engine import LLMEngine
        from jaxserve.output_paths import check_writable

        check_writable(out)
        seed = options["seed"]
        config = config_from_options(options)
        if config.async_scheduling:  # each step is timed around one `step()` call, which overlap would blur
            raise click.UsageError("calibrate times the synchronous engine loop; drop --async-scheduling")
        t0 = time.monotonic()
        try:
            engine = LLMEngine(config)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        click.echo(f"engine ready in {time.monotonic() - t0:.1f} s", err=True)
        cal = run_with_progress(engine, CalibrationConfig.quick() if quick else CalibrationConfig(), seed)
        cal.save(out)
        table = Table(title=f"calibrated profile -> {out}", show_header=False)
        for name, value in summary_rows(cal):
            table.add_row(name, value)
        Console().print(table)

    return calibrate_command


calibrate_command = _command()
