"""The report's disaggregated part measured in this process: the disaggregated engine (`engine/disaggregated.py`),
its prefill pool on devices 0..P-1 with TP P and its decode pool on the next D with TP D.

The engine counts each pool's busy time and work (`jaxserve.engine.pool_stats`) and keeps its recent steps. On CPU
the pools are fake devices on the same cores: while both compute, each is slower than calibrated alone. So every
step is also checked against the step model on its own shape, split by whether the other pool was busy for at
least half of it (`overlap_fractions`): that measures the slow-down. The capacities are not corrected.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.disaggregated import DisaggregatedEngine
from jaxserve.engine.pool_stats import POOL_COUNTERS, overlap_fractions
from jaxserve.measure.bench.datasets import DatasetConfig, generate
from jaxserve.measure.bench.load import LoadConfig, run_engine
from jaxserve.measure.report.context import avoid_tokens
from jaxserve.measure.report.disagg import PoolRun, pool_rows
from planner.step_model import StepShape, decode_shape, pad_tokens, prefill_shape, step_time_shape


def engine_config(cfg, p: int, d: int, token_buckets: tuple[int, ...]) -> EngineConfig:
    """The disaggregated engine: step budget one prompt, context prompt + output, the report engine's buckets
    below the prompt length (so decode batches are padded as in the rest of the report) and the prompt length."""
    n = cfg.disagg_input_len
    return EngineConfig(model=cfg.model, dtype=cfg.dtype, seed=cfg.seed, max_num_seqs=cfg.disagg_max_num_seqs,
                        max_num_batched_tokens=n, chunk_size=n, max_model_len=n + cfg.disagg_output_len,
                        kv_cache_memory=cfg.kv_cache_memory,
                        token_buckets=tuple(b for b in token_buckets if b < n) + (n,),
                        disaggregate=True, prefill_devices=p, decode_devices=d)


def run_disagg_engine(ctx) -> list[dict[str, Any]]:
    """Rows of kind `disagg` (`disagg.pool_rows`), measured on the in-process disaggregated engine."""
    cfg, log = ctx.cfg, ctx.log
    p, d = cfg.disagg
    t0 = time.monotonic()
    engine = DisaggregatedEngine(engine_config(cfg, p, d, tuple(ctx.engine.runner.token_buckets)))
    log(f"disaggregated engine {p}+{d} ready in {time.monotonic() - t0:.0f} s")

    def burst(num: int, seed: int):
        reqs = generate(DatasetConfig(name="random", num_prompts=num, input_len=cfg.disagg_input_len,
                                      output_len=cfg.disagg_output_len, seed=seed), ctx.spec.vocab_size,
                        avoid_tokens(ctx))
        return run_engine(engine, reqs, LoadConfig(), salt=ctx.next_salt())

    burst(2, cfg.seed + 5)  # first-run effects (transfers, host paths) stay out of the measurement
    for steps in engine.pool_steps.values():
        steps.clear()
    run = burst(cfg.disagg_num_prompts, cfg.seed + 6)
    c = run.counters
    checks = {"prefill": _step_check(ctx, engine, "prefill", "decode", p),
              "decode": _step_check(ctx, engine, "decode", "prefill", d)}
    return pool_rows(ctx, PoolRun(mode="engine", counters={k: c[k] for k in POOL_COUNTERS}, duration=run.duration,
                                  completed=sum(r.success for r in run.records), kv_transfers=c["kv_transfers"],
                                  kv_bytes=c["kv_transfer_bytes"], kv_seconds=c["kv_transfer_seconds"],
                                  checks=checks))


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
