"""Part `step` (issue 41 item 6): where a synthetic-1b decode step's time goes, and TPOT end to end.

With the platform's default loop, then with k = 1 and no async (the synchronous loop): TPOT through
`LLM.generate` (1024-token prompts, 64 greedy tokens) at 1 and 8 requests, and a `jax.profiler` trace of 20
decode steps at 1 and 8 requests (~1k context): the top kernels a step, the device's busy time against the step,
device-to-host copies a step and the host round trips among them (`trace_parse`). Figures against issue 41's
targets: TPOT <= 0.9 ms (1 request) and <= 1.0 ms (8) with the default loop, <= 1.3 ms with k = 1; decode
attention <= 6 us a layer for one 1k decode and <= 10 us for eight; 0 host round trips a step.
"""

from __future__ import annotations

import gc

from jaxserve.model.dtypes import planner_dtype, resolve_dtype
from modelspec.memory import weight_bytes_per_device
from modelspec.spec import PRESETS
from planner.hardware import load_hardware
from scripts.gpu_parts import trace_parse
from scripts.gpu_parts.common import Part, build_llm, engine_args, hardware_name, tpot_ms, trace_steps

ATTENTION = r"attention|split_kv"
TARGETS = {("default", 1): 0.9, ("default", 8): 1.0, ("k1", 1): 1.3}
ATTENTION_TARGETS = {1: 6.0, 8: 10.0}


def loop_run(part: Part, loop: str, overrides: dict, trace_batches: tuple[int, ...]) -> None:
    s = part.sizes
    llm = build_llm(part, f"{loop} engine", **engine_args(s, **overrides))
    if llm is None:
        return
    layers = PRESETS[s.model].num_layers
    for b in s.batches:
        r = part.run(f"{loop} tpot b{b}", lambda b=b: tpot_ms(llm, b, s), need_s=10)
        if (loop, b) in TARGETS:
            part.figure(f"TPOT, {loop} loop, {b} request(s)", r and r["tpot_ms"], "ms", "<=", TARGETS[loop, b], "41")
        if (loop, b) == ("default", 1):
            floor = part.record["results"]["weight_floor_ms"]
            part.figure("TPOT over the weight-read floor, default loop, 1 request", r and r["tpot_ms"] / floor, "x",
                        "<=", 1.75, "41")
    for b in trace_batches:
        t = part.run(f"{loop} trace b{b}", lambda b=b: trace_steps(llm.engine, b, s, part.out, f"{loop}_b{b}"),
                     need_s=10)
        if t is None:
            continue
        for line in trace_parse.render(t, f"{loop} loop, {b} request(s)"):
            part.log(line)
        part.figure(f"host round trips a step, {loop} loop, {b} request(s)", t["host_round_trips_per_step"], "",
                    "==", 0, "41")
        part.figure(f"device busy / traced step, {loop} loop, {b} request(s)", t["busy_us"] / max(t["step_us"], 1e-9),
                    "", None, None, "41")
        if loop == "default":
            us = trace_parse.kernel_us(t, ATTENTION)
            part.figure(f"decode attention a layer, {b} x ~{s.prompt_len} context", us and us / layers, "us", "<=",
                        ATTENTION_TARGETS.get(b, 10.0), "41")


def main() -> None:
    part = Part("step", __doc__.splitlines()[0], 110)
    s = part.sizes
    hw = load_hardware(hardware_name())
    spec = PRESETS[s.model]
    part.record["results"]["weight_floor_ms"] = 1e3 * weight_bytes_per_device(
        spec, planner_dtype(resolve_dtype(s.dtype))) / hw.memory_bw
    part.record["results"]["hardware"] = hw.name
    loop_run(part, "default", {}, s.batches)
    gc.collect()  # the default loop's engine and its KV pool go before the next one is built
    loop_run(part, "k1", {"async_scheduling": False, "num_scheduler_steps": 1}, s.batches[:1])
    part.finish()


if __name__ == "__main__":
    main()
