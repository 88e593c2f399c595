"""Tokens/s of the offline engine at several TP degrees, and disaggregated vs colocated, on fake CPU devices.

    python scripts/bench_parallel.py --model small --tp 1 2 4 --disagg 1+1 2+2

Sets XLA_FLAGS=--xla_force_host_platform_device_count=8 for itself when run on CPU (fake devices share the
host's cores, so this measures overheads and correctness of the sharded step, not a speed-up).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

ARGS = dict(max_num_seqs=16, max_num_batched_tokens=256, chunk_size=128, page_size=16, kv_cache_memory=64 * 2**20,
            max_model_len=1024)


def run(label: str, prompts: list[list[int]], max_tokens: int, **kw) -> None:
    from jaxserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**kw, **ARGS)
    built = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # first-use costs outside the timing
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = np.median([o.metrics.first_token_time - o.metrics.arrival_time for o in outs])
    extra = ""
    stats = llm.engine.stats()
    if "kv_transfers" in stats and stats["kv_transfers"]:
        extra = (f", KV moved {stats['kv_transfer_bytes'] / stats['kv_transfers'] / 1e3:.1f} kB/request in "
                 f"{stats['kv_transfer_seconds'] / stats['kv_transfers'] * 1e3:.2f} ms")
    print(f"{label:>12}: build+warm-up {built:5.1f} s, {gen / dt:7.1f} output tok/s, median TTFT {ttft * 1e3:6.0f} ms"
          f"{extra}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--tp", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--disagg", nargs="*", default=["1+1", "2+2"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, a.prompt_len).tolist() for _ in range(a.requests)]
    for tp in a.tp:
        run(f"TP {tp}", prompts, a.max_tokens, model=a.model, tensor_parallel_size=tp)
    for pair in a.disagg:
        p, d = (int(x) for x in pair.split("+"))
        run(f"disagg {pair}", prompts, a.max_tokens, model=a.model, disaggregate=True, prefill_devices=p,
            decode_devices=d)


if __name__ == "__main__":
    main()
