"""Decode cost of logits processing: 8 greedy requests on `small` (vocabulary 32000), 16-token prompts and 64
tokens each, plain against penalties and a logit_bias (the processed sampler), alternating three times.

Prints the median wall time per generated step of each. Usage: python scripts/bench_logits_processing.py
"""

import time

from jaxserve import LLM, SamplingParams

llm = LLM("small", max_num_seqs=8, max_num_batched_tokens=256, kv_cache_memory=64 * 2**20, max_model_len=1024)
PROCESSED = {"frequency_penalty": 0.5, "repetition_penalty": 1.1, "logit_bias": {5: 1.0}}


def per_step(kw: dict) -> float:
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, **kw)
    t = time.perf_counter()
    llm.generate([[i + 1] * 16 for i in range(8)], params)
    return (time.perf_counter() - t) / 64


times: dict[str, list[float]] = {"plain": [], "processed": []}
for _ in range(3):
    times["plain"].append(per_step({}))
    times["processed"].append(per_step(PROCESSED))
for name, values in times.items():
    print(f"{name}: median {sorted(values)[1] * 1e3:.1f} ms per step")
