"""Whole decode steps of `small` at 16 requests over float32, int8 and fp8 KV pages, three engines alternating.

    python scripts/bench_kv_cache_step.py

Each round gives every engine 16 fresh ~1024-token prompts (one token shorter each round: no prefix-cache hit) and
17 greedy tokens; the figure is the median gap between tokens after the last prompt's first token (pure 16-request
decode steps), then the median over rounds, and the median of the rounds' ratios to float32.
"""

from __future__ import annotations

import statistics

import numpy as np

from jaxserve import LLM, SamplingParams

KINDS = ("auto", "int8", "fp8")
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=1024, chunk_size=1024, max_model_len=1280,
              kv_cache_memory=400 * 2**20)


def decode_gaps(outs: list) -> list[float]:
    """Gaps between tokens once every request has its first token: steps of decodes only."""
    start = max(o.metrics.first_token_time for o in outs)
    return [b - a for o in outs for a, b in zip(o.metrics.token_times, o.metrics.token_times[1:], strict=False)
            if a >= start]


def main(rounds: int = 3) -> None:
    engines = {kind: LLM("small", kv_cache_dtype=kind, **ENGINE) for kind in KINDS}
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 30000, 1024)] for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    steps: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for r in range(rounds):
        for kind, llm in engines.items():
            steps[kind].append(statistics.median(decode_gaps(llm.generate([p[: -r - 1] for p in prompts], params))))
            print(f"round {r} {kind}: {steps[kind][-1] * 1e3:.2f} ms", flush=True)
    for kind in KINDS:
        ratio = statistics.median(a / b for a, b in zip(steps[kind], steps["auto"], strict=True))
        print(f"{kind}: decode step {statistics.median(steps[kind]) * 1e3:.2f} ms, {ratio:.3f}x float32")


if __name__ == "__main__":
    main()
