"""Where one decode step's time goes: host work vs device time, and the forward vs logits+sampling split.

    python scripts/profile_step.py --model small --batch 1
    python scripts/profile_step.py --model small --batch 1 --async-scheduling
    python scripts/profile_step.py --model small --batch 64 --top-p 0.9        # nucleus sampling on every row
    python scripts/profile_step.py --model small --batch 1 --breakdown         # the host's parts of a step

Runs `--batch` requests of `--prompt-len`-token prompts (default 128) to steady decode, then times `--steps`
engine steps: the wait for the device (forward + sampler) and the rest (scheduling, batch layout, dispatch, stop
checks), and then the jitted forward and the jitted sampler alone on the same inputs, each repeated and then
the two back to back (a repeated sampler reads the LM head's weights from a warm cache; after the forward they
come from memory). With
`--async-scheduling` the host works while the device runs the previous step, so the host share is what the
device waits for the host (the dispatch of the next step), not the host's whole work. `--breakdown` also times
the host's parts of a step (scheduling, the two jitted calls, the copy back, post-processing) by wrapping the
engine's methods with timers, which add about a microsecond each.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable

import jax
import numpy as np


def timed(obj: object, name: str, totals: dict[str, float], label: str | None = None) -> Callable[[], None]:
    """Wrap `obj.name` so that its calls add their wall time to totals[label]; returns the undo."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label or name] += time.perf_counter() - t

    if hasattr(inner, "_cache_size"):  # a jitted function: the engine counts its compilations
        wrapper._cache_size = inner._cache_size
    setattr(obj, name, wrapper)
    return lambda: setattr(obj, name, inner)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="KV pool size; a step's time must not grow with it (the pool is donated, not copied)")
    ap.add_argument("--breakdown", action="store_true", help="also time the host's parts of a step")
    args = ap.parse_args()

    from jaxserve.config.engine import EngineConfig
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.runner.sampler import SamplingArrays

    kv = None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30)
    # No warm-up: the untimed steps below compile the only buckets this run uses (prefill, decode).
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=max(16, args.batch),
                                    kv_cache_memory=kv, warmup=False,
                                    async_scheduling=args.async_scheduling))
    runner = engine.runner
    # Just enough tokens for the steps below: the scheduler reserves KV pages for a share of each request's
    # remaining max_tokens, and 2048 of them let only 28 of 64 requests run at once in a 1 GiB pool.
    params = SamplingParams(temperature=args.temperature or (1.0 if args.top_p < 1 else 0.0), top_p=args.top_p,
                            max_tokens=args.steps + 64, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"p{i}", [(i + j) % 1000 + 1 for j in range(args.prompt_len)], params)
    engine.step()
    while engine.last_step.num_prefill_tokens:  # prefill done: every timed step is a decode step
        engine.step()
    for _ in range(3):
        engine.step()
    decoding = engine.last_step.num_decode_tokens
    waits: list[float] = []
    collect = runner.collect

    def timed_collect(pending, batch, sampling):
        t = time.perf_counter()
        jax.block_until_ready(pending)
        waits.append(time.perf_counter() - t)
        return collect(pending, batch, sampling)

    runner.collect = timed_collect
    parts: dict[str, float] = collections.defaultdict(float)
    undo = []
    if args.breakdown:
        # In call order; a part's time includes the parts it calls (dispatch holds both jitted calls; collect
        # holds the device wait, which is reported apart).
        for obj, name, label in [(engine.scheduler, "schedule", "schedule"),
                                 (engine, "_sampling_for", "sampling rows"),
                                 (runner, "_device_inputs", "step inputs"),
                                 (runner, "dispatch", "dispatch (inputs + both calls)"),
                                 (runner, "_forward", "forward call"),
                                 *([(runner, "_forward_wide", "forward call")]
                                   if runner._forward_wide is not runner._forward else []),
                                 (runner, "_sample", "sampler call"),
                                 (runner, "collect", "collect (less the wait)"),
                                 (engine.scheduler, "update_after_step", "scheduler update"),
                                 (engine.scheduler, "advance_after_dispatch", "scheduler update"),
                                 (engine, "_postprocess", "post-process (stops, outputs)"),
                                 (engine, "_record_step", "step stats")]:
            undo.append(timed(obj, name, parts, label))
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step = (time.perf_counter() - t) / args.steps
    for u in reversed(undo):
        u()
    runner.collect = collect

    batch = engine.scheduler.schedule()
    sampling = SamplingArrays.build([(params, 0, 0)] * batch.num_seqs, runner.sampling_bucket(batch.num_seqs))
    from jaxserve.runner.model_runner import bucket_for

    packed = runner._device_inputs(batch, bucket_for(batch.num_tokens, runner.token_buckets))
    rows = (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.seed, sampling.step,
            np.bool_(False))

    def forward():
        hidden, runner.kv_caches = runner._forward(runner.param_leaves, runner.kv_caches, packed, runner._no_prev)
        return hidden

    hidden = jax.block_until_ready(forward())
    t = time.perf_counter()
    for _ in range(args.steps):
        jax.block_until_ready(forward())
    fwd = (time.perf_counter() - t) / args.steps
    t = time.perf_counter()
    for _ in range(args.steps):
        jax.block_until_ready(runner._sample(runner.param_leaves, hidden, *rows))
    smp = (time.perf_counter() - t) / args.steps
    t = time.perf_counter()
    for _ in range(args.steps):
        jax.block_until_ready(runner._sample(runner.param_leaves, forward(), *rows))
    both = (time.perf_counter() - t) / args.steps
    wait = float(np.mean(waits))
    pool_gib = sum(a.nbytes for a in jax.tree.leaves(runner.kv_caches)) / 2**30
    dtype = jax.tree.leaves(runner.kv_caches)[0].dtype
    mode = "async scheduling" if args.async_scheduling else "sync"
    print(f"{args.model} ({dtype}, KV pool {pool_gib:.2f} GiB, {mode}), {decoding} decoding: "
          f"step {step * 1e3:.1f} ms = device wait {wait * 1e3:.1f} ms + "
          f"host {(step - wait) * 1e3:.1f} ms; alone: forward {fwd * 1e3:.1f} ms, logits+sampling {smp * 1e3:.1f} ms, "
          f"the two back to back {both * 1e3:.1f} ms")
    if args.breakdown:
        parts["collect (less the wait)"] -= sum(waits)
        print("host parts per step (us):")
        for label, total in parts.items():
            print(f"  {label:32s} {total / args.steps * 1e6:8.1f}")


if __name__ == "__main__":
    main()
