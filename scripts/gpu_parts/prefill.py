"""Part `prefill` (issue 42 item 2): a prefill step's MFU and where its time goes, synthetic-1b in bf16.

The synchronous loop (each step timed whole): a 2048-token prompt prefilled in one step (the median over reps,
after one untimed), and an 8k prompt in 2048-token chunks (first token's wall time over its chunk steps); MFU is
the planner's FLOPs of those chunks (`planner.step_model.op_costs`) over the time over the device's bf16 peak.
A trace of each (the 2048-token step, and the long prompt's chunks) prints its top kernels. Target: >= 60% MFU.
"""

from __future__ import annotations

import time

import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.model.dtypes import planner_dtype, resolve_dtype
from modelspec.spec import PRESETS
from planner.hardware import load_hardware
from planner.step_model import op_costs, prefill_shape
from scripts.gpu_parts import trace_parse
from scripts.gpu_parts.common import Part, engine_args, greedy, hardware_name, prompts, trace_run


def prompt_flops(spec, n: int, chunk: int, dtype: str) -> float:
    """The planner's FLOPs of prefilling `n` tokens in `chunk`-token chunks."""
    total, done = 0.0, 0
    while done < n:
        c = min(chunk, n - done)
        total += sum(o.count * o.flops for o in op_costs(spec, prefill_shape(c, done), dtype=dtype, padded_tokens=c))
        done += c
    return total


def first_token(engine: LLMEngine, ids: list[int], rid: str) -> dict:
    """Add one prompt, step until its first token: the wall time and each step's."""
    engine.add_request(rid, ids, greedy(1))
    steps, t0 = [], time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return {"ms": 1e3 * (time.perf_counter() - t0), "steps_ms": [1e3 * x for x in steps]}


def main() -> None:
    part = Part("prefill", __doc__.splitlines()[0], 45)
    s = part.sizes
    hw = load_hardware(hardware_name())
    dtype = planner_dtype(resolve_dtype(s.dtype))
    spec, peak = PRESETS[s.model], hw.peak(dtype)
    holder = {}

    def build():
        t = time.perf_counter()
        holder["engine"] = LLMEngine(EngineConfig(**engine_args(s, async_scheduling=False)))
        return {"build_s": time.perf_counter() - t, "loop": holder["engine"].loop.name}

    if part.run("engine", build) is None:
        return part.finish()
    engine = holder["engine"]
    n = s.step_budget

    def one_step():
        runs = [first_token(engine, prompts(1, n, salt=r)[0], f"p{r}") for r in range(s.reps + 2)]
        ms = float(np.median([r["ms"] for r in runs[1:]]))
        flops = prompt_flops(spec, n, n, dtype)
        return {"step_ms": ms, "steps": len(runs[-1]["steps_ms"]), "flops": flops, "mfu": flops / (ms / 1e3) / peak}

    r = part.run(f"prefill {n}", one_step, need_s=5)
    part.figure(f"MFU, one {n}-token prefill step", r and r["mfu"], "", ">=", 0.6, "42")
    t = part.run(f"trace prefill {n}", lambda: trace_run(
        lambda: [first_token(engine, prompts(1, n, salt=9 + i)[0], f"tp{i}") for i in range(2)], 2, part.out,
        f"prefill_{n}"), need_s=5)
    if t is not None:
        part.log("\n".join(trace_parse.render(t, f"prefill {n}")))

    def long_prompt():
        first_token(engine, prompts(1, s.long_prompt, salt=20)[0], "warm")  # the chunk steps' variants compile
        runs = [first_token(engine, prompts(1, s.long_prompt, salt=21 + r)[0], f"l{r}") for r in range(s.reps)]
        ms = float(np.median([r["ms"] for r in runs]))
        flops = prompt_flops(spec, s.long_prompt, n, dtype)
        return {"ttft_ms": ms, "chunk_steps_ms": runs[-1]["steps_ms"], "flops": flops,
                "mfu": flops / (ms / 1e3) / peak}

    r = part.run(f"prompt {s.long_prompt} in {n}-token chunks", long_prompt, need_s=10)
    part.figure(f"MFU, a {s.long_prompt}-token prompt in {n}-token chunks", r and r["mfu"], "", ">=", 0.6, "42")
    t = part.run(f"trace prompt {s.long_prompt}", lambda: trace_run(
        lambda: first_token(engine, prompts(1, s.long_prompt, salt=40)[0], "tl"), -(-s.long_prompt // n),
        part.out, f"prefill_{s.long_prompt}"), need_s=8)
    if t is not None:
        part.log("\n".join(trace_parse.render(t, f"prompt {s.long_prompt}, a chunk step")))
    part.finish()


if __name__ == "__main__":
    main()
