"""Greedy tokens of the synthetic MoE preset at several tensor-parallel degrees, on 8 fake CPU devices.

Run as a subprocess (`python tests/moe_tp_driver.py 1 2 4`): the device count is fixed before JAX starts. Prints
one JSON line: per degree the tokens, and the per-device shape of one expert tensor (to show it is split).
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402

import numpy as np  # noqa: E402

ARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=32, page_size=16, kv_cache_memory=2 * 2**20,
            max_model_len=256, token_buckets=(8, 64), seq_buckets=(8,), warmup=False)


def main(degrees: list[int]) -> None:
    from jaxserve import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 17, 40, 5)]
    sp = SamplingParams(temperature=0, max_tokens=12)
    result = {}
    for tp in degrees:
        llm = LLM("tiny-moe", tensor_parallel_size=tp, **ARGS)
        experts = llm.engine.runner.params["layers"][0]["mlp"]["experts_gate_up"][...]
        result[str(tp)] = {"tokens": [o.outputs[0].token_ids for o in llm.generate(prompts, sp)],
                           "expert_shard_shape": list(experts.addressable_shards[0].data.shape),
                           "expert_shape": list(experts.shape)}
    print(json.dumps(result))


if __name__ == "__main__":
    main([int(d) for d in sys.argv[1:]])
