"""`jaxserve bench latency`: static batches over a grid of batch sizes x input lengths.

Each point sends `batch_size` random prompts of `input_len` tokens at once and draws `output_len` tokens for
each: TTFT is the batch's prefill as each request saw it, TPOT the decode time per token, the decode step the
median gap between tokens.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from jaxserve.measure.bench.datasets import DatasetConfig, generate
from jaxserve.measure.bench.load import LoadConfig, run_engine
from jaxserve.measure.bench.results import spec_decode_metrics


@dataclass
class LatencyPoint:
    """Measured static-batch latencies of one grid point (ms; throughput in output tokens/s)."""

    batch_size: int
    input_len: int
    output_len: int
    ttft_ms: float  # mean over the batch
    prefill_ms: float  # until the last request of the batch has its first token
    tpot_ms: float  # mean per-request TPOT
    decode_step_ms: float  # median inter-token gap
    e2e_ms: float  # the whole batch
    output_throughput: float
    spec_acceptance_rate: float | None = None  # speculative decoding: accepted / proposed tokens
    spec_acceptance_length: float | None = None  # tokens per verify step

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def measure_point(engine, batch_size: int, input_len: int, output_len: int, *, seed: int = 0,
                  salt: str = "") -> LatencyPoint:
    """Run one static batch on `engine` and summarise it (best of nothing: one run)."""
    vocab = engine.spec.vocab_size
    eos = engine.spec.eos_token_id
    reqs = generate(DatasetConfig(name="random", num_prompts=batch_size, input_len=input_len,
                                  output_len=output_len, seed=seed), vocab, (eos,) if eos is not None else ())
    run = run_engine(engine, reqs, LoadConfig(), salt=salt or f"lat{seed}-{batch_size}-{input_len}")
    ok = [r for r in run.records if r.success]
    if not ok:
        errors = {r.error for r in run.records}
        raise ValueError(f"batch {batch_size} x {input_len}: every request failed ({'; '.join(errors)})")
    ttfts = [r.ttft for r in ok]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    gaps = [g for r in ok for g in r.itl]
    spec = spec_decode_metrics(ok)
    return LatencyPoint(batch_size=batch_size, input_len=input_len, output_len=output_len,
                        ttft_ms=1e3 * float(np.mean(ttfts)), prefill_ms=1e3 * max(ttfts),
                        tpot_ms=1e3 * float(np.mean(tpots)) if tpots else math.nan,
                        decode_step_ms=1e3 * float(np.median(gaps)) if gaps else math.nan,
                        e2e_ms=1e3 * run.duration, output_throughput=sum(r.output_len for r in ok) / run.duration,
                        spec_acceptance_rate=spec.get("spec_decode_acceptance_rate"),
                        spec_acceptance_length=spec.get("spec_decode_acceptance_length"))


def run_grid(engine, batch_sizes: Sequence[int], input_lens: Sequence[int], output_len: int, *, seed: int = 0,
             on_point: Callable[[LatencyPoint], None] | None = None) -> list[LatencyPoint]:
    """Measure every (batch size, input length) point after one small warm-up batch."""
    measure_point(engine, 1, min(input_lens), 2, seed=seed + 10_000, salt=f"latwarm{seed}")
    points = []
    for k, (b, n) in enumerate(itertools.product(batch_sizes, input_lens)):
        p = measure_point(engine, b, n, output_len, seed=seed + k, salt=f"lat{seed}-{k}")
        points.append(p)
        if on_point is not None:
            on_point(p)
    return points


def format_table(points: Sequence[LatencyPoint]) -> str:
    """A plain text table of the grid."""
    head = f"{'batch':>6} {'input':>6} {'output':>6} {'TTFT ms':>9} {'prefill ms':>10} {'TPOT ms':>9} " \
           f"{'step ms':>8} {'tok/s':>9}"
    rows = [head, "-" * len(head)]
    for p in points:
        rows.append(f"{p.batch_size:>6} {p.input_len:>6} {p.output_len:>6} {p.ttft_ms:>9.1f} {p.prefill_ms:>10.1f} "
                    f"{p.tpot_ms:>9.2f} {p.decode_step_ms:>8.2f} {p.output_throughput:>9.1f}")
    return "\n".join(rows)
