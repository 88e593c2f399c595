"""The GPU check's trace reader (scripts/gpu_parts/trace_parse.py) on small hand-made profiler traces: a GPU's
(CUPTI kernels and copies on device streams) and a CPU's (XLA's thunk events)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.gpu_parts.trace_parse import kernel_us, render, summarize  # noqa: E402


def meta(pid: int, name: str) -> dict:
    return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}


def ev(pid: int, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "pid": pid, "tid": 1, "ts": ts, "dur": dur, "name": name, "args": args}


def test_a_gpu_trace_gives_busy_time_copies_and_host_round_trips_per_step():
    events = [meta(1, "/device:GPU:0"), meta(7, "/host:CPU")]
    for step in range(2):
        t0 = 1000.0 * step
        events += [ev(7, "$llm_engine.py:177 step", t0, 900.0),
                   ev(1, "split_kv_decode_s8_g4_bk64", t0 + 10, 100.0, hlo_module="jit__forward_impl"),
                   ev(1, "gemm_fusion_dot_1", t0 + 50, 100.0, hlo_module="jit__forward_impl"),  # overlaps: union
                   ev(1, "MemcpyH2D", t0, 2.0),
                   ev(1, "MemcpyD2H", t0 + 200, 2.0, hlo_module="jit__sample_impl", hlo_op="cond.3"),
                   ev(1, "MemcpyD2H", t0 + 400, 2.0)]  # the tokens' copy after the step: no round trip
    s = summarize(events, steps=2)
    assert s["source"] == "gpu" and s["step_us"] == 900.0 and s["step_source"] == "LLMEngine.step events"
    assert s["busy_us"] == 140.0 and s["kernels_per_step"] == 2.0
    assert s["d2h_per_step"] == 2.0 and s["h2d_per_step"] == 1.0
    assert s["host_round_trips_per_step"] == 1.0 and s["round_trip_ops"] == ["cond.3"]
    assert kernel_us(s, r"attention|split_kv") == 100.0 and kernel_us(s, "no such kernel") is None
    assert "split_kv_decode_s8_g4_bk64" in "\n".join(render(s, "two steps"))


def test_a_cpu_trace_reads_xla_thunks_as_the_kernels():
    events = [meta(7, "/host:CPU"), ev(7, "fusion.1", 0.0, 30.0, hlo_op="fusion.1", hlo_module="jit_f"),
              ev(7, "end: fusion.1", 30.0, 0.0, hlo_op="fusion.1"), ev(7, "while.2", 40.0, 10.0, hlo_op="while.2"),
              ev(7, "PjitFunction(f)", 0.0, 60.0)]
    s = summarize(events, steps=1)
    assert s["source"] == "cpu" and s["kernels_per_step"] == 2.0 and s["busy_us"] == 40.0
    assert s["host_round_trips_per_step"] == 1.0 and s["step_us"] == 50.0  # no step events: the device span
