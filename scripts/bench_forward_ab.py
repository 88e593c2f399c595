"""The jitted forward of one decode step under several engine variants, built in one process and timed alternately.

    python scripts/bench_forward_ab.py --batch 16 --eigen-max-rows 16,0
    python scripts/bench_forward_ab.py --batch 20 --token-buckets "1,2,4,8,16,32,64;1,2,4,8,16,24,32,64"
    python scripts/bench_forward_ab.py --batch 64 --cpu-kernels 1,0
    python scripts/bench_forward_ab.py --batch 8 --cpu-matmul-max-rows 32,0

Each variant is one engine (`small`, float32, a 256 MiB KV pool) running `--batch` decodes after 128-token
prompts; `--eigen-max-rows` sets `jaxserve.model.layers.CPU_EIGEN_MAX_ROWS` while that engine first traces its
forward (0: every projection goes to XLA's default GEMM); `--cpu-matmul-max-rows` sets
`jaxserve.kernels.cpu.matmul.MAX_ROWS` the same way (0: no projection goes to jaxserve's matmul kernel);
`--cpu-kernels 0` keeps attention and projections in XLA.
Rounds alternate the variants, so a machine that
slows down mid-run slows all of them; the script prints each round's median, the median of the rounds, and
the median over rounds of each variant's time over the first variant's (robust to such slowdowns).
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import numpy as np

import jaxserve.kernels.cpu.matmul as cpu_matmul
import jaxserve.model.layers as layers
from jaxserve.config.engine import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.runner.model_runner import bucket_for


def decode_forward(model: str, batch: int, eigen_max_rows: int, matmul_max_rows: int, token_buckets: tuple[int, ...],
                   kernel: bool):
    """A zero-argument function running one engine's jitted forward on a decode step of `batch` requests."""
    layers.CPU_EIGEN_MAX_ROWS = eigen_max_rows
    cpu_matmul.MAX_ROWS = matmul_max_rows
    budget = {"max_num_batched_tokens": token_buckets[-1]} if token_buckets else {}
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=max(32, batch), kv_cache_memory=256 << 20,
                                    warmup=False, token_buckets=token_buckets, cpu_kernels=kernel,
                                    **budget))
    forward = forward_on_decodes(engine, batch)
    jax.block_until_ready(forward())  # compiles, with the routing set above
    return forward


def forward_on_decodes(engine: LLMEngine, batch: int):
    """A zero-argument function running `engine`'s jitted forward on a decode step of `batch` 128-token requests
    (added and prefilled here; each call writes that step's KV again)."""
    params = SamplingParams(max_tokens=256, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{i}", [(i + j) % 1000 + 1 for j in range(128)], params)
    engine.step()
    while engine.last_step.num_prefill_tokens:
        engine.step()
    runner, step = engine.runner, engine.scheduler.schedule()
    packed = runner._device_inputs(step, bucket_for(step.num_tokens, runner.token_buckets))

    def forward():
        hidden, runner.kv_caches = runner._forward(runner.param_leaves, runner.kv_caches, packed, runner._no_prev)
        return hidden

    return forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eigen-max-rows", default=str(layers.CPU_EIGEN_MAX_ROWS), help="comma-separated variants")
    ap.add_argument("--cpu-matmul-max-rows", default=str(cpu_matmul.MAX_ROWS), help="comma-separated variants")
    ap.add_argument("--token-buckets", default="", help="';'-separated ladders, each comma-separated; "
                    "empty: the engine's default")
    ap.add_argument("--cpu-kernels", default="1", help="comma-separated variants, 1 or 0")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=25)
    args = ap.parse_args()
    ladders = [tuple(int(b) for b in s.split(",")) if s else () for s in args.token_buckets.split(";")]
    kernels = [bool(int(k)) for k in args.cpu_kernels.split(",")]
    variants = list(itertools.product([int(r) for r in args.eigen_max_rows.split(",")],
                                      [int(r) for r in args.cpu_matmul_max_rows.split(",")], ladders, kernels))
    forwards = [decode_forward(args.model, args.batch, *variant) for variant in variants]
    medians: list[list[float]] = [[] for _ in variants]
    for _ in range(args.rounds):
        for i, forward in enumerate(forwards):
            times = []
            for _ in range(args.calls):
                t = time.perf_counter()
                jax.block_until_ready(forward())
                times.append(time.perf_counter() - t)
            medians[i].append(float(np.median(times)) * 1e3)
    for (rows, matmul_rows, ladder, kernel), ms in zip(variants, medians, strict=True):
        ratio = float(np.median(np.array(ms) / np.array(medians[0])))
        print(f"{args.model}, {args.batch} decodes, eigen_max_rows={rows}, cpu_matmul_max_rows={matmul_rows}, "
              f"buckets={ladder or 'default'}, "
              f"cpu_kernels={kernel}: forward "
              f"{float(np.median(ms)):.2f} ms, {ratio:.3f}x the first variant (median of the rounds' ratios; "
              f"rounds: {', '.join(f'{m:.2f}' for m in ms)})")


if __name__ == "__main__":
    main()
