"""Where one request's decode step goes on this CPU, against the weight-read floor measured in the same process:
jaxserve's step part by part, and llama.cpp's from its own timings.

    python scripts/step_breakdown.py --model small
    python scripts/step_breakdown.py --model small --async-scheduling     # the overlapped loop
    python scripts/step_breakdown.py --model small --llamacpp-src /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp
    python scripts/step_breakdown.py --model tiny --steps 3 --stream-mib 64 --out /tmp/b.json   # the smoke test's

In one process, in this order: the streaming sum over `--stream-mib` (calibrate's bandwidth), then jaxserve with one
request of a `--prompt-len` prompt decoding: the engine step's wall time over `--steps` steps, then a trace of as
many (`trace_step.decode_parts`: the forward, each projection kind's time and weight bandwidth, attention, the rest
of the forward, the sampler's LM head and draw, the gaps between the two calls and from a step's sampler to the next
step's forward, which is the host's work between steps); with `--llamacpp-src`, llama.cpp on the same model
converted to GGUF F32: its per-token eval time (`llama_perf_context`) and the wall time of a step as the benchmark
drives it, then a second run observed op by op through llama.cpp's eval callback (every matmul's output asked for,
so the graph runs in pieces: times per matmul kind, inflated by a split's overhead, against the unobserved eval);
then the streaming sum again and the one-row matmul kernel over one matrix of that size (`measure_weight_read`:
the kernel's own best read, one call of long rows). The bandwidth is the higher of the sum's mean and the kernel's
read: on this EPYC the sum read well below what two threads read (docs/tuning.md).

The floor of a part is its weight bytes over that bandwidth; the step's floor is every weight byte (the tied
embedding once) over it. Prints a table; `--out` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from trace_step import decode_parts, print_decode_parts, traced


def layer_weight_bytes(spec) -> dict[str, int]:
    """A layer's float32 weight bytes per projection kind, as jaxserve fuses them."""
    h, d = spec.hidden_size, spec.head_dim
    return {"qkv": h * (spec.num_heads + 2 * spec.num_kv_heads) * d * 4, "o": spec.num_heads * d * h * 4,
            "gate_up": h * 2 * spec.intermediate_size * 4, "down": spec.intermediate_size * h * 4}


def jaxserve_step(model: str, prompt_len: int, steps: int, async_scheduling: bool = False) -> dict:
    """One request decoding: step wall times (untraced), then a trace of as many steps read back. With
    `async_scheduling` the overlapped loop: the host's work for a step runs while the one before computes."""
    from jaxserve.config.engine import EngineConfig
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=16, warmup=False, async_scheduling=async_scheduling))
    plan = engine.runner.ops.matmul.plan
    params = SamplingParams(temperature=0, max_tokens=3 * steps + 64, ignore_eos=True)
    engine.add_request("p0", [j % 1000 + 1 for j in range(prompt_len)], params)
    while engine.last_step is None or engine.last_step.num_prefill_tokens:
        engine.step()
    for _ in range(5):
        engine.step()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    res = decode_parts(traced(lambda: [engine.step() for _ in range(steps)]), engine.spec)
    res["step_ms"] = float(np.median(walls)) * 1e3
    res["kernel_plan"] = plan.describe() if plan else "XLA only"
    return res


def llamacpp_step(spec, src: Path, prompt_len: int, steps: int, threads: int) -> dict:
    """llama.cpp on `spec` (random weights, GGUF F32): its eval time per token and a step's wall time, then the
    same steps observed matmul by matmul through its eval callback."""
    import llama_cpp as lc
    from hf_peer import hf_model
    from llama_cpp._ggml import libggml
    from llamacpp_peer import LlamaCppRunner, convert_to_gguf

    libggml.ggml_get_name.restype = ctypes.c_char_p
    libggml.ggml_get_name.argtypes = [ctypes.c_void_p]
    libggml.ggml_op_desc.restype = ctypes.c_char_p
    libggml.ggml_op_desc.argtypes = [ctypes.c_void_p]
    prompt = [[j % 1000 + 1 for j in range(prompt_len)]]
    marks: list[tuple[float, str]] = []

    def observe(tensor, ask, _user):
        if ask:  # which nodes the scheduler stops after: every matmul's output
            return libggml.ggml_op_desc(tensor) == b"MUL_MAT"
        marks.append((time.perf_counter(), libggml.ggml_get_name(tensor).decode()))
        return True

    callback = lc.ggml_backend_sched_eval_callback(observe)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        gguf = convert_to_gguf(hf_model(spec, threads), Path(tmp), src)
        for observed in (False, True):
            runner = LlamaCppRunner(gguf, 1, prompt_len + steps + 2, threads,
                                    eval_callback=callback if observed else None)
            runner.generate(prompt, 2)  # warm
            lc.llama_perf_context_reset(runner.ctx)
            marks.clear()
            res = runner.generate(prompt, steps)
            perf = lc.llama_perf_context(runner.ctx)
            runner.close()
            key = "observed" if observed else "plain"
            out[key] = {"step_ms": res["llamacpp_tpot_ms"], "eval_ms": perf.t_eval_ms / max(1, perf.n_eval),
                        "evals": perf.n_eval}
        # Every llama_decode marks as many matmuls; the prompt's come first. Time since the previous mark, per
        # kind of matmul (its name less the layer); a step's first mark also holds the host's work between steps.
        per_step = len(marks) // steps
        parts: dict[str, float] = {}
        for i in range(per_step, len(marks)):
            kind = "host + first matmul" if i % per_step == 0 else marks[i][1].rsplit("-", 1)[0]
            parts[kind] = parts.get(kind, 0.0) + (marks[i][0] - marks[i - 1][0]) * 1e3 / (steps - 1)
        out["observed"]["parts_ms"] = parts
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's and HF's threads")
    ap.add_argument("--llamacpp-src", default=None, help="llama.cpp's source folder (convert_hf_to_gguf.py)")
    ap.add_argument("--async-scheduling", action="store_true", help="jaxserve's overlapped loop")
    ap.add_argument("--stream-mib", type=int, default=1024, help="the bandwidth measurements' array size")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps must be at least 3")
    if args.llamacpp_src and not Path(args.llamacpp_src, "convert_hf_to_gguf.py").exists():
        ap.error("--llamacpp-src must point at llama.cpp's source (with convert_hf_to_gguf.py)")

    from jaxserve.measure.calibrate.microbench import measure_bandwidth, measure_weight_read
    from modelspec.memory import weight_bytes_per_device
    from modelspec.spec import load_model_spec

    spec = load_model_spec(args.model)
    stream = args.stream_mib * 2**20
    before = measure_bandwidth(stream)
    js = jaxserve_step(args.model, args.prompt_len, args.steps, args.async_scheduling)
    peer = (llamacpp_step(spec, Path(args.llamacpp_src), args.prompt_len, args.steps, args.threads)
            if args.llamacpp_src else None)
    after = measure_bandwidth(stream)
    kernel_bw = max(filter(None, [measure_weight_read(stream) for _ in range(2)]), default=None)
    bw = max((before + after) / 2, kernel_bw or 0.0)
    weights = weight_bytes_per_device(spec, "fp32")
    layer = layer_weight_bytes(spec)
    head = spec.vocab_size * spec.hidden_size * 4
    floor_ms = weights / bw * 1e3
    report = {"model": args.model, "bandwidth_gbps": bw / 1e9, "stream_sum_gbps": [before / 1e9, after / 1e9],
              "kernel_one_row_gbps": kernel_bw / 1e9 if kernel_bw else None, "weight_mb": weights / 1e6,
              "floor_ms": floor_ms, "jaxserve": js, "llamacpp": peer,
              "floors_ms": {**{k: spec.num_layers * b / bw * 1e3 for k, b in layer.items()},
                            "lm_head": head / bw * 1e3}}
    report["jaxserve"]["step_over_floor"] = js["step_ms"] / floor_ms

    print(f"{args.model}: {weights / 1e6:.0f} MB of weights; streaming sum {before / 1e9:.1f} / {after / 1e9:.1f} GB/s "
          f"(before / after), the one-row kernel over as much {kernel_bw / 1e9 if kernel_bw else float('nan'):.1f} "
          f"GB/s; floor {floor_ms:.2f} ms at {bw / 1e9:.1f} GB/s")
    print(f"jaxserve ({js['kernel_plan']}): step {js['step_ms']:.2f} ms = {js['step_ms'] / floor_ms:.2f}x the floor")
    print_decode_parts(js, "  traced (medians):")
    print("  floors: " + ", ".join(f"{k} {v:.2f} ms" for k, v in report["floors_ms"].items()))
    if peer:
        plain, obs = peer["plain"], peer["observed"]
        print(f"llama.cpp: step {plain['step_ms']:.2f} ms = {plain['step_ms'] / floor_ms:.2f}x the floor, its eval "
              f"{plain['eval_ms']:.2f} ms a token; observed op by op: step {obs['step_ms']:.2f} ms, eval "
              f"{obs['eval_ms']:.2f} ms: " + ", ".join(f"{k} {v:.2f}" for k, v in obs["parts_ms"].items()))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
