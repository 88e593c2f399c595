"""What every part of `jaxserve report` shares: its config, the context the parts run in, rows and formatting."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxserve.config.engine import EngineConfig
from jaxserve.runner.buckets import half_octave_ladder
from planner.serving import ServingConfig

Log = Callable[[str], None]


@dataclass
class ReportConfig:
    """Sizes of every part of the report; defaults take a few minutes for `small` on 2 CPU cores."""

    model: str = "small"
    dtype: str = "auto"
    quantization: str | None = None  # --quantization: int8/fp8 weights (calibrated and priced as such)
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype
    seed: int = 0
    max_num_seqs: int = 32
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    context_lens: tuple[int, ...] = (128, 512)
    # 48 tokens: a one-request TPOT over fewer gaps spans too short a time to average out a shared VM's swings,
    # which alone could carry the TPOT headline past its limit; see docs/tuning.md.
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
    disagg: tuple[int, int] | None = None  # (prefill devices, decode devices): run the disaggregated part
    disagg_in_process: bool = False  # the disaggregated engine in this process, also on a CPU (report/disagg.py)
    disagg_only: bool = False  # no grid, loads or chunked prefill: only the disaggregated part
    disagg_input_len: int = 128
    disagg_output_len: int = 32
    disagg_num_prompts: int = 48
    disagg_max_num_seqs: int = 16
    speculative: str | None = None  # a --speculative-config JSON: run the speculative row (report/speculative.py)
    spec_prompt_len: int = 128
    spec_output_len: int = 64
    # One request's TPOT on a shared VM moves 10-25% from run to run: the row takes the median of this many
    # alternations (each ~0.1 s for bard).
    spec_repeats: int = 9

    @classmethod
    def quick_config(cls, model: str = "tiny") -> ReportConfig:
        return cls(model=model, max_num_seqs=8, batch_sizes=(1, 4), context_lens=(16, 64), grid_output_len=4,
                   load_input_len=32, load_output_len=4, load_num_prompts=6, long_prompt_len=128, long_decodes=2,
                   long_decode_input=16, long_tail_tokens=4, disagg_input_len=32, disagg_output_len=4,
                   disagg_num_prompts=6, disagg_max_num_seqs=4, spec_prompt_len=32, spec_output_len=16, spec_repeats=1,
                   quick=True)

    @property
    def budget(self) -> int:
        """Step token budget: the whole long prompt and its decodes fit in one step (the unchunked run)."""
        return (self.long_prompt_len + self.long_decodes + 63) // 64 * 64

    def engine_config(self) -> EngineConfig:
        # The synchronous loop, as calibrate times it and the planner prices it (on any platform).
        return EngineConfig(model=self.model, dtype=self.dtype, seed=self.seed, max_num_seqs=self.max_num_seqs,
                            async_scheduling=False, quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
                            max_num_batched_tokens=self.budget, chunk_size=self.budget,
                            kv_cache_memory=self.kv_cache_memory,
                            token_buckets=half_octave_ladder(self.budget) if self.token_buckets is None
                            else self.token_buckets)


@dataclass
class Context:
    """What every part needs: the engine, the model spec, the calibrated hardware and the planner dtypes (the
    weights' and the KV pool's: `calibrate.planner_dtypes`)."""

    engine: Any
    spec: Any
    hw: Any
    dtype: str
    cfg: ReportConfig
    log: Log = print
    salt: int = 0
    kv_dtype: str | None = None  # None: `dtype`
    pool_hw: Any = None  # the disaggregated pools' profile (calibrated on one pool's cores), None: `hw`
    facts: Any = None  # DeviceFacts, as the engine's policy read them at start-up (default: the engine's)

    def __post_init__(self) -> None:
        if self.facts is None and self.engine is not None:
            self.facts = self.engine.policy.facts

    @property
    def dtypes(self) -> dict[str, str | None]:
        """The planner's dtype keywords for this engine (every planner call of the report takes them)."""
        return {"dtype": self.dtype, "kv_dtype": self.kv_dtype}

    def next_salt(self) -> str:
        self.salt += 1
        return f"report{self.cfg.seed}-{self.salt}"

    def serving_config(self, budget: int | None = None) -> ServingConfig:
        c = self.engine.config
        extra = {}
        if "token_buckets" in ServingConfig.__dataclass_fields__:  # once the planner models padding
            extra["token_buckets"] = tuple(self.engine.runner.token_buckets)
        return ServingConfig(max_num_seqs=c.max_num_seqs, chunk_size=budget or self.cfg.budget, page_size=c.page_size,
                             **self.dtypes, **extra)


def error_pct(pred: float | None, meas: float | None) -> float | None:
    """(pred - meas) / meas in percent; None when either is missing, zero or not finite."""
    if pred is None or meas is None or not meas or not math.isfinite(pred) or not math.isfinite(meas):
        return None
    return 100.0 * (pred - meas) / meas


def result_row(kind: str, config: dict[str, Any], pred: dict[str, float | None], meas: dict[str, float | None],
               **extra: Any) -> dict[str, Any]:
    """One report row: predicted, measured and error for TTFT, TPOT and throughput, plus `extra` fields."""
    row: dict[str, Any] = {"kind": kind, "config": config}
    for k in ("ttft_ms", "tpot_ms", "throughput"):
        row[f"predicted_{k}"] = pred.get(k)
        row[f"measured_{k}"] = meas.get(k)
        row[f"{k.split('_')[0]}_error_pct"] = error_pct(pred.get(k), meas.get(k))
    row.update(extra)
    return row


def avoid_tokens(ctx: Context) -> tuple[int, ...]:
    """Token ids random prompts must not contain (EOS would end a measured request early)."""
    eos = ctx.spec.eos_token_id
    return (eos,) if eos is not None else ()


def fmt(v: Any, spec: str = ".1f") -> str:
    """A number for a table, or "-" when it is missing."""
    return "-" if v is None else format(v, spec)


def fmt_pct(v: float | None) -> str:
    """A signed percentage for a table, or "-"."""
    return "-" if v is None else f"{v:+.1f}%"
