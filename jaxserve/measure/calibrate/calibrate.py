"""`jaxserve calibrate`: measure the local JAX device and the engine, fit the planner's coefficients.

Measures streaming bandwidth, dense matmul peak, GEMM throughput across M at the model's MLP shape, and real
engine steps: lone prefills, decode batches over sequences x context (the attention cost), and decodes with a
chunked long prompt beside them (mixed steps). The step times are fitted with `calibrate_fit` to the planner's
additive model; the result is a hardware profile JSON for `jaxserve plan --hardware profile.json`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.measure.calibrate.microbench import (
    engine_mlp_weights,
    local_hardware,
    measure_bandwidth,
    measure_gemm_rows,
    measure_matmul,
    measure_weight_streams,
)
from jaxserve.measure.calibrate.steps import (
    PromptSource,
    StepSample,
    fit_decode_context,
    measure_decode,
    measure_dispatch_overhead,
    measure_mixed,
    measure_prefill,
    one_step_dispatches,
    step_budget,
    warm_engine,
)
from jaxserve.model.attention.backend import smallest_chunk
from jaxserve.model.dtypes import planner_dtype
from planner.api import choose_num_scheduler_steps
from planner.calibration import Sample, fit_coefficients
from planner.hardware import GIGA, Hardware
from planner.step_model import pad_tokens, step_time_shape

Progress = Callable[[str, float], None]  # (phase description, fraction of the whole done)


@dataclass
class CalibrationConfig:
    """Sizes of the measurements; `quick()` is for tests."""

    # 2048 and 3072: long lone prefills, so the fit sees attention's cost apart from the chunked (mixed) steps'.
    # With 2048 alone, the report's 4096-token prompt came out slow: the CPU kernel's tiles of a long prompt run at
    # a better rate than the many mixed steps' shorter chunks (docs/tuning.md).
    # 136 and 264: prompts just past a bucket (192 and 384 on the half-octave ladder), so the fit sees padded rows
    # as a Poisson load's prefill steps run them (a 128-token prompt beside a few decodes).
    prefill_lens: tuple[int, ...] = (16, 64, 136, 256, 264, 512, 2048, 3072)
    # Nine decode points of ten steps each: with five points of six steps, one noisy decode step moved the
    # report's TPOT headline by several percent.
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    decode_contexts: tuple[int, ...] = (64, 512)
    decode_steps: int = 10
    # Every decode point is measured in this many rounds over all of them, each a sample of its own: a shared VM's
    # speed moves within seconds, and with one round it skewed neighbouring points of one calibration enough to
    # move the report's TPOT headline (docs/tuning.md).
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
    # One request's tokens with one decode step a dispatch against `dispatch_steps` a dispatch, alternating: the
    # host overhead per dispatch (`dispatch_overhead_s`) that --num-scheduler-steps saves.
    dispatch_steps: int = 4
    dispatch_tokens: int = 33
    dispatch_rounds: int = 3
    gemm_rows: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)
    bandwidth_bytes: int = 256 * 2**20
    matmul_n: int = 1024
    repeats: int = 2

    @classmethod
    def quick(cls) -> CalibrationConfig:
        return cls(prefill_lens=(16, 32), decode_batches=(1, 4), decode_contexts=(16, 64), decode_steps=3,
                   decode_rounds=1, mixed_decodes=2, mixed_prompt_len=96, mixed_chunk=32, mixed_small_prompt_len=64,
                   mixed_small_samples=2, dispatch_tokens=9, dispatch_rounds=1, gemm_rows=(1, 16, 64),
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
    dtype: str  # planner dtype name of the measured engine's weights: fp32 | bf16 | fp16 | int8 | fp8
    samples: list[StepSample] = field(default_factory=list)
    measurements: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    kv_dtype: str | None = None  # the KV pool's planner dtype name, where it is not `dtype`

    def profile(self) -> dict[str, Any]:
        """The profile JSON object (loadable by planner.hardware.load_hardware)."""
        d = self.hardware.to_profile()
        d["device"] = self.measurements.get("device", "")
        kv = f", KV in {self.kv_dtype}" if self.kv_dtype and self.kv_dtype != self.dtype else ""
        d["notes"] = (f"jaxserve calibrate on {self.measurements.get('model')} in {self.dtype}{kv}: "
                      f"step-time fit median |error| {self.fit.median_abs_error:.1%}, max {self.fit.max_abs_error:.1%} "
                      f"over {len(self.samples)} engine steps; per-layer overhead folded into step_overhead_s")
        d["measurements"] = self.measurements
        return d

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.profile(), indent=2) + "\n")


def planner_dtypes(engine) -> tuple[str, str]:
    """The planner's dtype names of what `engine` runs: its weights (`--quantization` int8/fp8, else its float
    dtype) and its KV pool (`--kv-cache-dtype`, else its float dtype). The profile is calibrated, and the report
    priced, in these: an int8 engine's weight term is one byte a weight at the rate its int8 matmul reads codes."""
    config, float_name = engine.config, planner_dtype(engine.dtype)
    return config.quantization or float_name, float_name if config.kv_cache_dtype == "auto" else config.kv_cache_dtype


def calibrate(engine, cfg: CalibrationConfig | None = None, progress: Progress | None = None,
              seed: int = 0) -> Calibration:
    """Measure the device and `engine` (an LLMEngine, warmed up), fit the coefficients. Its steps are timed one
    decode step a dispatch, whatever `engine.config.num_scheduler_steps` says."""
    with one_step_dispatches(engine):
        return _calibrate(engine, cfg or CalibrationConfig(), progress, seed)


def _calibrate(engine, cfg: CalibrationConfig, progress: Progress | None, seed: int) -> Calibration:
    say = progress or (lambda phase, frac: None)
    t0 = time.monotonic()
    dtype, kv_dtype = planner_dtypes(engine)
    spec = engine.spec
    say("memory bandwidth", 0.0)
    bw = measure_bandwidth(cfg.bandwidth_bytes)
    say("matmul peak", 0.05)
    peak = measure_matmul(cfg.matmul_n, engine.dtype)
    say("GEMM rows", 0.1)
    weights = engine_mlp_weights(engine)  # the engine's own: int8/fp8 codes in a quantized engine
    gemm = measure_gemm_rows(cfg.gemm_rows, spec.hidden_size, 2 * spec.intermediate_size, engine.dtype,
                             route=engine.runner.ops.matmul,
                             weight=weights[0] if engine.config.quantization else None)
    hw, device = local_hardware(engine.policy.facts, bw, peak, planner_dtype(engine.dtype), weight_dtype=dtype)
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
    # a context the model's length cannot hold with the point's steps is measured at the longest one it can
    points = list(dict.fromkeys((b, fit_decode_context(b, c, cfg.decode_steps, budget, engine.max_model_len))
                                for b, c in points))
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
    finest = smallest_chunk(engine.runner.ops.attention, page)
    chunks = cfg.mixed_small_chunks or tuple(sorted({page, finest}, reverse=True))
    for chunk in chunks:
        say(f"engine mixed steps: {chunk}-token chunks over a long prompt", 0.88)
        prompt = min(cfg.mixed_small_prompt_len, engine.max_model_len - 1)
        with step_budget(engine, engine.config.max_num_batched_tokens, chunk=chunk):
            small = measure_mixed(engine, ids, decodes, prompt)
        every = max(1, len(small) // cfg.mixed_small_samples)
        samples += small[every - 1::every]  # ends at (or near) the longest history
    say("dispatch overhead (several decode steps a dispatch)", 0.92)
    dispatch = measure_dispatch_overhead(engine, ids, cfg.dispatch_steps, cfg.dispatch_tokens, cfg.dispatch_rounds)
    say("fitting", 0.95)
    # With one model the weight term barely varies between steps, so it is measured: two rows through every
    # layer's widest weight, the engine's own; their bandwidth over the stream's is weight_bw_eff. One row runs
    # another kernel on a CPU (XLA's GEMV), whose rate the fit takes from the engine's one-decode steps
    # (gemv_speedup): measured apart, its stream jumped between calibrations while the engine's one-row steps did
    # not (docs/tuning.md). The one-row stream is kept as a measurement. A quantized engine's weights are its
    # codes, read by its own matmul (the int8 kernel converts them in registers, slower per byte than the float
    # kernel streams floats), so weight_bw_eff is then that matmul's rate, applied to the planner's byte a weight.
    streams = measure_weight_streams(weights, route=engine.runner.ops.matmul, dtype=engine.dtype)
    stream, stream_rows = streams[1], streams[2]
    fixed = {"weight_bw_eff": float(np.clip(stream_rows / bw, 0.01, 1.5))}
    buckets = engine.runner.token_buckets
    fit_samples = [Sample(s.shape, s.seconds, pad_tokens(s.shape.num_tokens, buckets)) for s in samples]
    coefficients, _ = fit_coefficients(spec, hw, fit_samples, dtype=dtype, kv_dtype=kv_dtype, fixed=fixed)
    hw = hw.with_coefficients(**{**coefficients.to_dict(), "dispatch_overhead_s": dispatch})
    errors = [step_time_shape(spec, hw, s.shape, dtype=dtype, kv_dtype=kv_dtype,
                              padded_tokens=s.padded_tokens).total_s / s.seconds - 1 for s in fit_samples]
    fit = FitResult(median_abs_error=float(np.median(np.abs(errors))), max_abs_error=float(np.max(np.abs(errors))),
                    errors=errors, fixed=fixed)
    attention = _attention_slopes(samples)
    measurements = {
        "device": device, "model": spec.name, "dtype": dtype, "kv_dtype": kv_dtype,
        "compute_dtype": planner_dtype(engine.dtype), "memory_bandwidth_gbps": bw / GIGA,
        "matmul_tflops": peak / 1e12, "matmul_n": cfg.matmul_n, "gemm_rows": gemm, "fixed_coefficients": fixed,
        "weight_stream_gbps": stream / GIGA, "weight_stream_2_rows_gbps": stream_rows / GIGA,
        "attention_us_per_seq_token": attention, "dispatch_overhead_ms": dispatch * 1e3,
        "recommended_num_scheduler_steps": choose_num_scheduler_steps(spec, hw, dtype=dtype, kv_dtype=kv_dtype),
        "engine": {"max_num_seqs": engine.config.max_num_seqs,
                   "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                   "chunk_size": engine.config.chunk_size, "page_size": engine.config.page_size},
        "steps": [{"kind": s.kind, "num_decode": s.shape.num_decode, "prefill_tokens": s.shape.prefill_tokens,
                   "decode_context": s.shape.decode_context, "ms": s.seconds * 1e3, "fit_error": e}
                  for s, e in zip(samples, fit.errors, strict=True)],
    }
    say("done", 1.0)
    return Calibration(hardware=hw, fit=fit, dtype=dtype, samples=samples, measurements=measurements,
                       seconds=time.monotonic() - t0, kv_dtype=kv_dtype)


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
