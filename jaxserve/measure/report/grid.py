"""The report's static grid: batch sizes x context lengths, measured and simulated on the same budget."""

from __future__ import annotations

from typing import Any

from jaxserve.measure.bench.latency import measure_point
from jaxserve.measure.report.context import Context, result_row
from planner.serving import Workload
from planner.simulate import simulate
from planner.step_model import decode_shape, step_time_shape


def run_grid(ctx: Context) -> list[dict[str, Any]]:
    """Static batches: measured vs the planner's simulation of the same batch on the same scheduler budget."""
    cfg = ctx.cfg
    measure_point(ctx.engine, 1, min(cfg.context_lens), 2, seed=cfg.seed + 999, salt=ctx.next_salt())
    rows = []
    for b in cfg.batch_sizes:
        for c in cfg.context_lens:
            p = measure_point(ctx.engine, b, c, cfg.grid_output_len, seed=cfg.seed + b * 7919 + c,
                              salt=ctx.next_salt())
            sim = simulate(ctx.spec, ctx.hw, Workload(input_len=c, output_len=cfg.grid_output_len, concurrency=b),
                           ctx.serving_config(), num_requests=b, warmup_fraction=0.0)
            step = decode_step_ms(ctx, b, c + cfg.grid_output_len / 2)
            rows.append(result_row("grid", {"batch_size": b, "context_len": c, "output_len": cfg.grid_output_len},
                             {"ttft_ms": sim.ttft.mean, "tpot_ms": sim.tpot.mean,
                              "throughput": sim.output_tokens_per_s},
                             {"ttft_ms": p.ttft_ms, "tpot_ms": p.tpot_ms, "throughput": p.output_throughput},
                             predicteddecode_step_ms=step, measureddecode_step_ms=p.decode_step_ms))
            ctx.log(f"grid {b:>3} x {c:>5}: TPOT {p.tpot_ms:7.2f} ms (pred {sim.tpot.mean:7.2f}), "
                    f"TTFT {p.ttft_ms:8.1f} ms (pred {sim.ttft.mean:8.1f})")
    return rows


def decode_step_ms(ctx: Context, batch: int, context: float) -> float:
    """The step model's time of one decode step of `batch` sequences at `context` tokens each."""
    return step_time_shape(ctx.spec, ctx.hw, decode_shape(batch, context), **ctx.dtypes).total_ms
