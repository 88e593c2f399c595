"""int8 or fp8 weights (`--quantization`) against float32: the decode step's forward, and quality on a trained model.

    python scripts/bench_quantized.py --model small --batches 1,16
    python scripts/bench_quantized.py --quality-model bard --skip-speed [--quantization fp8]

Speed: two engines of `--model` (float32, a 256 MiB KV pool), one per variant, each with `--batch` decodes after
128-token prompts, timing the jitted forward alone and the engine's whole step (`--what`); rounds alternate the
variants (one process), so a machine that slows mid-run slows both; the figure is the median over rounds of
the quantized time over float32's (fp8 runs in XLA's dot over converted codes: slow on a CPU, meant for GPUs).
Quality: held-out perplexity of `--quality-model` both ways and the fraction of the first 32 greedy positions
(8 prompts) before the two diverge.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import jax
import numpy as np
from bench_forward_ab import forward_on_decodes  # scripts/ is on the path when a script runs

from jaxserve import LLM
from jaxserve.config.engine import EngineConfig
from jaxserve.core.tokenizer import load_tokenizer
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.measure.eval.agreement import agreement_counts, greedy_tokens
from jaxserve.measure.eval.perplexity import perplexity
from jaxserve.measure.eval.windows import read_eval_text
from jaxserve.model.quantize import param_bytes


def decode_forward(model: str, batch: int, quantization: str | None):
    """({"forward", "step"}: zero-argument functions running one engine's jitted decode forward of `batch` requests
    and its whole step, parameter bytes, the engine's float dtype name)."""
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=max(32, batch), kv_cache_memory=256 << 20,
                                    warmup=False, quantization=quantization))
    forward = forward_on_decodes(engine, batch)

    def whole_step():  # the engine's step: schedule, forward, LM head, sampling, outputs (the requests advance)
        return engine.step()

    jax.block_until_ready(forward())
    whole_step()
    return {"forward": forward, "step": whole_step}, param_bytes(engine.runner.param_leaves), engine.dtype.name


def speed(model: str, batch: int, rounds: int, calls: int, what: str, method: str = "int8") -> None:
    variants = (None, method)
    built = [decode_forward(model, batch, q) for q in variants]
    medians: list[list[float]] = [[], []]
    for _ in range(rounds):
        for (fns, _, _), ms in zip(built, medians, strict=True):
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                jax.block_until_ready(fns[what]())
                times.append(time.perf_counter() - t)
            ms.append(float(np.median(times)) * 1e3)
    ratio = float(np.median(np.array(medians[1]) / np.array(medians[0])))
    name = built[0][2]  # float32 on a CPU, bfloat16 on a GPU
    print(f"{model}, {batch} decodes, {what}: {name} {np.median(medians[0]):.2f} ms ({built[0][1] / 2**20:.1f} MiB of "
          f"parameters), {method} {np.median(medians[1]):.2f} ms ({built[1][1] / 2**20:.1f} MiB): {method}/{name} = "
          f"{ratio:.3f} (median of {rounds} rounds' ratios; {name} rounds {', '.join(f'{m:.2f}' for m in medians[0])};"
          f" {method} rounds {', '.join(f'{m:.2f}' for m in medians[1])})")


def quality(model: str, method: str = "int8") -> None:
    ids = load_tokenizer(model).encode(read_eval_text(model, "held-out"), add_special_tokens=False)[:3000]
    engine = dict(max_num_seqs=8, max_num_batched_tokens=128, chunk_size=128, kv_cache_memory=4 << 20)
    llms = [LLM(model, **engine), LLM(model, quantization=method, **engine)]
    ppl = [perplexity(llm.engine, ids, 200).perplexity for llm in llms]
    prompts = [ids[i:i + 16] for i in range(0, 8 * 64, 64)]
    same, exact, total = agreement_counts(*(greedy_tokens(llm, prompts) for llm in llms))
    print(f"{model}: held-out perplexity float32 {ppl[0]:.4f}, {method} {ppl[1]:.4f} ({ppl[1] / ppl[0] - 1:+.3%}); "
          f"greedy: {same}/{total} positions before the first divergence, {exact}/{total} positions equal")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--quality-model", default="bard")
    ap.add_argument("--quantization", default="int8", choices=("int8", "fp8"))
    ap.add_argument("--what", default="forward,step", help="forward (the jitted decode forward alone) and/or step "
                    "(the engine's whole decode step, LM head and sampling included)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-quality", action="store_true")
    args = ap.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"CPU: {name}, {len(jax.devices())} device(s), jax {jax.__version__}")
    if not args.skip_quality:
        quality(args.quality_model, args.quantization)
    if not args.skip_speed:
        for batch in (int(b) for b in args.batches.split(",")):
            for what in args.what.split(","):
                speed(args.model, batch, args.rounds, args.calls, what, args.quantization)


if __name__ == "__main__":
    main()
