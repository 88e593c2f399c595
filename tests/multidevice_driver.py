"""Runs multi-device checks in a fresh process with 8 fake CPU devices and prints one JSON line.

The device count must be fixed before JAX initialises, so tests run this file as a subprocess
(`python tests/multidevice_driver.py tp`) and the rest of the suite keeps seeing one device.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

ARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=32, page_size=16, kv_cache_memory=2 * 2**20,
            max_model_len=256, token_buckets=(8, 64), seq_buckets=(8,))


def prompts(seed: int = 0, lengths: tuple[int, ...] = (3, 17, 40, 70, 5)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


def run_tp(degrees: list[int], **engine_args) -> dict:
    """Greedy tokens, top logprobs, compile counts and KV shard shapes for each TP degree."""
    from jaxserve import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=10, logprobs=3)
    result = {}
    for tp in degrees:
        llm = LLM("tiny", tensor_parallel_size=tp, **ARGS, **engine_args)
        runner = llm.engine.runner
        compiled = runner.compile_count()
        outs = llm.generate(prompts(), sp)
        k = runner.kv_caches[0][0]
        result[str(tp)] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[sorted(step.values()) for step in o.outputs[0].logprobs] for o in outs],
            "compiles_after_warmup": runner.compile_count() - compiled,
            "kv_shape": list(k.shape),
            "kv_shard_shape": list(k.addressable_shards[0].data.shape),
            "kv_devices": len(k.sharding.device_set),
            "num_pages": llm.engine.num_pages,
            "attention": type(runner.ops.attention).__name__,
        }
    return result


def run_disagg(pairs: list[tuple[int, int]]) -> dict:
    """Greedy tokens colocated and disaggregated (prefill devices, decode devices), with transfer records."""
    from jaxserve import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=10)
    shared = prompts(1, (40,))[0]  # two prompts with a 2-page common prefix: a prefix hit on the prefill side
    batch = prompts() + [shared[:32] + [7, 8, 9], shared[:32] + [10, 11]]
    result = {"colocated": [o.outputs[0].token_ids for o in LLM("tiny", **ARGS).generate(batch, sp)]}
    for p, d in pairs:
        llm = LLM("tiny", disaggregate=True, prefill_devices=p, decode_devices=d, **ARGS)
        engine = llm.engine
        compiled = engine.runner.compile_count() + engine.prefill.runner.compile_count()
        start = time.perf_counter()
        first = llm.generate(batch[:-1], sp)
        second = llm.generate(batch[-1:], sp)  # after the first batch: hits its cached prefix
        seconds = time.perf_counter() - start
        engine.integrity_check()
        result[f"{p}+{d}"] = {
            "tokens": [o.outputs[0].token_ids for o in first + second],
            "prompt_lens": {o.request_id: len(o.prompt_token_ids) for o in first + second},
            "transfers": [[t.request_id, t.num_tokens, t.num_bytes, t.block_bytes] for t in engine.transfers],
            "ttft_after_transfer": all(o.metrics.first_token_time >= o.metrics.first_scheduled_time
                                       for o in first + second),
            "cached_tokens": second[0].num_cached_tokens,
            "compiles_after_warmup": engine.runner.compile_count() + engine.prefill.runner.compile_count() - compiled,
            "stats": engine.stats(),
            "seconds": seconds,
            "pool_steps": {pool: [list(x) for x in v] for pool, v in engine.pool_steps.items()},
        }
    return result


def run_disagg_aborts(seed: int = 0) -> dict:
    """A random workload with aborts at random steps, with a tight decode pool; page accounting after it."""
    from jaxserve import LLM, SamplingParams

    rng = np.random.default_rng(seed)
    llm = LLM("tiny", disaggregate=True, prefill_devices=1, decode_devices=1, max_pending_transfers=2,
              **{**ARGS, "kv_cache_memory": 2**18})
    engine = llm.engine
    aborted, finished, max_pending = set(), set(), 0
    n = 24
    for i in range(n):
        params = SamplingParams(temperature=float(rng.choice([0.0, 1.0])), max_tokens=int(rng.integers(1, 100)),
                                seed=i)
        engine.add_request(f"r{i}", rng.integers(0, 256, int(rng.integers(1, 120))).tolist(), params)
    live = [f"r{i}" for i in range(n)]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        max_pending = max(max_pending, len(engine._pending))
        if rng.random() < 0.06:
            candidates = [r for r in live if r not in finished and r not in aborted]
            if candidates:
                rid = str(rng.choice(candidates))
                engine.abort_request(rid)
                aborted.add(rid)
        engine.integrity_check()
    pre, dec = engine.prefill.kv_manager, engine.kv_manager
    return {"finished": len(finished), "aborted": len(aborted), "max_pending": max_pending,
            "prefill_used": pre.num_used_pages, "prefill_free": pre.num_free_pages,
            "prefill_usable": pre.num_usable_pages,
            "decode_used": dec.num_used_pages, "decode_free": dec.allocator.num_free,
            "decode_usable": dec.num_usable_pages, "transfers": engine.counters["kv_transfers"],
            "preemptions": engine.counters["num_preemptions"]}


def run_tp_checkpoint(degrees: list[int]) -> dict:
    """Greedy tokens of an HF checkpoint with qkv bias and an untied head (Qwen2-style), per TP degree."""
    import dataclasses
    import tempfile

    from flax import nnx

    from jaxserve import LLM, SamplingParams
    from jaxserve.model.checkpoint import save_hf_checkpoint
    from jaxserve.model.llama import LlamaForCausalLM
    from modelspec.spec import PRESETS

    spec = dataclasses.replace(PRESETS["tiny"], name="tiny-qwen", architecture="qwen2", qkv_bias=True,
                               tie_word_embeddings=False, synthetic=False)
    folder = save_hf_checkpoint(LlamaForCausalLM(spec, rngs=nnx.Rngs(3)), spec, tempfile.mkdtemp() + "/hf")
    sp = SamplingParams(temperature=0, max_tokens=8)
    return {str(tp): [o.outputs[0].token_ids for o in LLM(str(folder), tensor_parallel_size=tp, **ARGS)
                      .generate(prompts(2, (9, 33)), sp)] for tp in degrees}


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "tp":
        print(json.dumps(run_tp([int(x) for x in rest])))
    elif mode == "tp-batched-decode":  # the reference's accelerator tuning (batched decodes), forced on CPU
        from jaxserve.model.attention.reference import ACCELERATOR_TUNING
        from jaxserve.platform import policy

        policy.select_backend = lambda *args, **kwargs: ACCELERATOR_TUNING
        print(json.dumps(run_tp([int(x) for x in rest])))
    elif mode == "tp-async":  # asynchronous scheduling on a mesh, every step overlapped (as on a GPU)
        import jaxserve.platform.policy

        jaxserve.platform.policy.CPU_OVERLAP_MAX_TOKENS = 10**9
        print(json.dumps(run_tp([int(x) for x in rest], async_scheduling=True)))
    elif mode == "tp-pallas":  # the Pallas kernels (interpreted on a CPU) under shard_map on the TP mesh
        backend, *degrees = rest
        print(json.dumps(run_tp([int(x) for x in degrees], attention_backend=backend)))
    elif mode == "tp-checkpoint":
        print(json.dumps(run_tp_checkpoint([int(x) for x in rest])))
    elif mode == "disagg":
        print(json.dumps(run_disagg([tuple(int(x) for x in pair.split("+")) for pair in rest])))
    elif mode == "disagg-aborts":
        print(json.dumps(run_disagg_aborts(*(int(x) for x in rest))))
    else:
        raise SystemExit(f"unknown mode {mode}")
