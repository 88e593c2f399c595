"""Part `b8` (issue 41 item 6): the Llama-3.1-8B-shaped random model (`synthetic-8b`, bf16) at 8 requests.

Its engine with the platform's default loop (weights drawn on the device, `jaxserve/model/synthetic.py`): TPOT
through `LLM.generate` (8 x 1024-token prompts, 64 greedy tokens) and a trace of 20 decode steps at 8 requests.
Target (issue 41): <= 4.5 ms a step (vLLM's CI: ~6.5 ms for the real 8B on an H200); the weight-read floor beside it.
"""

from __future__ import annotations

from jaxserve.model.dtypes import planner_dtype, resolve_dtype
from modelspec.memory import weight_bytes_per_device
from modelspec.spec import PRESETS
from planner.hardware import load_hardware
from scripts.gpu_parts import trace_parse
from scripts.gpu_parts.common import Part, build_llm, engine_args, hardware_name, tpot_ms, trace_steps


def main() -> None:
    part = Part("b8", __doc__.splitlines()[0], 70)
    s = part.sizes
    hw = load_hardware(hardware_name())
    batch = max(s.batches)
    part.record["results"]["weight_floor_ms"] = 1e3 * weight_bytes_per_device(
        PRESETS[s.big_model], planner_dtype(resolve_dtype(s.dtype))) / hw.memory_bw
    llm = build_llm(part, "engine", **engine_args(s, model=s.big_model))
    if llm is not None:
        r = part.run(f"tpot b{batch}", lambda: tpot_ms(llm, batch, s), need_s=15)
        part.figure(f"{s.big_model} TPOT, default loop, {batch} requests", r and r["tpot_ms"], "ms", "<=", 4.5, "41")
        t = part.run(f"trace b{batch}", lambda: trace_steps(llm.engine, batch, s, part.out, f"b8_b{batch}"),
                     need_s=10)
        if t is not None:
            for line in trace_parse.render(t, f"{s.big_model}, {batch} requests"):
                part.log(line)
            part.figure(f"{s.big_model} traced step, {batch} requests", t["step_us"] / 1e3, "ms", "<=", 4.5, "41")
            part.figure(f"{s.big_model} device busy a step, {batch} requests (weight-read floor "
                        f"{part.record['results']['weight_floor_ms']:.2f} ms)", t["busy_us"] / 1e3, "ms", None, None,
                        "41")
    part.finish()


if __name__ == "__main__":
    main()
