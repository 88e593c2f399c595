"""What one cached turn costs: N new tokens after H cached tokens, against N (and a short M) fresh tokens.

    python scripts/bench_cached_turn.py --model small --history 1200 --new 288 --short 80

Runs each prompt alone (max_tokens=1, so the time is the prefill) on an engine with 512-token steps, three times
with fresh random tokens; the difference between the cached turn and the same number of fresh tokens is the
turn's attention over its cached history.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--history", type=int, default=1200)
    ap.add_argument("--new", type=int, default=288)
    ap.add_argument("--short", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from jaxserve.config.engine import EngineConfig
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=16, max_num_batched_tokens=512, chunk_size=512))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)

    def tokens(n: int) -> list[int]:
        return [int(x) for x in rng.integers(300, engine.spec.vocab_size, n)]

    def prefill_ms(request_id: str, prompt: list[int]) -> float:
        start = time.perf_counter()
        engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        return (time.perf_counter() - start) * 1e3

    for i in range(args.repeats):
        history = tokens(args.history)
        prefill_ms(f"history{i}", history)
        cached = prefill_ms(f"cached{i}", history + tokens(args.new))
        fresh = prefill_ms(f"fresh{i}", tokens(args.new))
        short = prefill_ms(f"short{i}", tokens(args.short))
        print(f"{args.new} new tokens after {args.history} cached: {cached:.0f} ms; {args.new} fresh: {fresh:.0f} ms; "
              f"{args.short} fresh: {short:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
