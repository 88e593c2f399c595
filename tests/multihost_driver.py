"""One process of a localhost `jax.distributed` job on CPU (one device each): prints process 0's greedy tokens.

`python tests/multihost_driver.py PORT NUM_PROCESSES PROCESS_ID [TP]`; with NUM_PROCESSES 1 it runs alone (the
reference). The mesh spans every process's devices: TP defaults to NUM_PROCESSES (one device per process).
"""

from __future__ import annotations

import json
import sys

ARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=32, page_size=16, kv_cache_memory=2 * 2**20,
            max_model_len=256, token_buckets=(8, 64), seq_buckets=(8,))
PROMPTS = [[5, 9, 200, 17], list(range(30, 100)), [101] * 21]

if __name__ == "__main__":
    port, n, pid = (int(x) for x in sys.argv[1:4])
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else n
    from jaxserve import LLM, SamplingParams

    kw = dict(coordinator_address=f"localhost:{port}", num_processes=n, process_id=pid) if n > 1 else {}
    llm = LLM("tiny", tensor_parallel_size=tp, **ARGS, **kw)  # processes > 0 follow inside and exit here
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    more = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.8, seed=3, max_tokens=6))
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs + more],
                      "devices": len(llm.engine.runner.kv_caches[0][0].sharding.device_set)}), flush=True)
