"""Where a decode step's device time goes, kernel by kernel, from a jax.profiler trace of the engine's steps.

    python scripts/trace_step.py --model small --batch 1
    python scripts/trace_step.py --model small --batch 16 --prompt-len 512

Runs `--batch` requests to steady decode, traces `--steps` engine steps and reads the trace back (XLA's CPU
runtime records every thunk). Prints, per step (medians): the forward's and the sampler's executions, the
forward's time in each kind of kernel call of a layer (the qkv, o, gate/up and down projections with the weight
bandwidth each reached, and attention), in its other thunks and between thunks, the gap between the forward's
end and the sampler's start, and how late XLA's other intra-op thread started on each projection (it sleeps
when idle; a call runs on the calling thread until the other one joins). CPU only, with jaxserve's kernels.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import itertools
import tempfile

import jax
import numpy as np

# A layer's custom calls in the order the model makes them (`jaxserve/model/llama.py`).
LAYER_CALLS = ("qkv", "attention", "o", "gate_up", "down")


def executions(profile) -> list[tuple[int, int, list[tuple[int, int, str]]]]:
    """Every executable run on XLA's CPU client threads: (start ns, duration ns, its thunks)."""
    runs = []
    for plane in profile.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLAPjRt"):
                continue
            current = None
            for start, dur, name in sorted((e.start_ns, e.duration_ns, e.name) for e in line.events):
                if name == "ThunkExecutor::Execute":
                    current = (start, dur, [])
                    runs.append(current)
                elif current and start < current[0] + current[1] and not name.startswith(("end:", "Threadpool")):
                    current[2].append((start, dur, name))
    return sorted(runs)


def helper_starts(profile) -> list[int]:
    """When XLA's intra-op threads started a task (ns), sorted."""
    return sorted(e.start_ns for plane in profile.planes for line in plane.lines
                  if line.name.startswith("tf_XLAEigen") for e in line.events
                  if e.name == "ThreadpoolListener::StartRegion")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()

    from jaxserve.engine import LLMEngine
    from jaxserve.engine_config import EngineConfig
    from jaxserve.model import cpu_kernels
    from jaxserve.sampling_params import SamplingParams

    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        ap.error("this trace reads jaxserve's CPU kernels: it needs a CPU and the kernels built")
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=max(16, args.batch), warmup=False))
    params = SamplingParams(temperature=0, max_tokens=args.steps + 64, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"p{i}", [(i + j) % 1000 + 1 for j in range(args.prompt_len)], params)
    engine.step()
    while engine.last_step.num_prefill_tokens:
        engine.step()
    for _ in range(5):
        engine.step()
    folder = tempfile.mkdtemp(prefix="jaxserve-trace-")
    jax.profiler.start_trace(folder)
    for _ in range(args.steps):
        engine.step()
    jax.profiler.stop_trace()
    profile = jax.profiler.ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])

    spec = engine.spec
    h, d = spec.hidden_size, spec.head_dim
    qkv_out = (spec.num_heads + 2 * spec.num_kv_heads) * d
    weight_bytes = {"qkv": h * qkv_out * 4, "o": spec.num_heads * d * h * 4,
                    "gate_up": h * 2 * spec.intermediate_size * 4, "down": spec.intermediate_size * h * 4}
    runs = executions(profile)
    layers = spec.num_layers
    forwards = [r for r in runs if sum(t[2].startswith("ffi_call") for t in r[2]) >= len(LAYER_CALLS) * layers]
    samplers = [r for r in runs if r not in forwards]
    parts: dict[str, list[float]] = collections.defaultdict(list)
    late: dict[str, list[float]] = collections.defaultdict(list)
    starts = helper_starts(profile)
    for _, dur, thunks in forwards:
        calls = [t for t in thunks if t[2].startswith("ffi_call")][: len(LAYER_CALLS) * layers]
        per = collections.defaultdict(float)
        for i, (t0, t_dur, _) in enumerate(calls):
            kind = LAYER_CALLS[i % len(LAYER_CALLS)]
            per[kind] += t_dur
            j = bisect.bisect_left(starts, t0)
            if kind != "attention":
                late[kind].append((starts[j] - t0) / 1e3 if j < len(starts) and starts[j] < t0 + t_dur else np.nan)
        per["other thunks"] = sum(t[1] for t in thunks) - sum(t[1] for t in calls)
        per["between thunks"] = dur - sum(t[1] for t in thunks)
        for kind, ns in per.items():
            parts[kind].append(ns)
    gaps = [b[0] - (a[0] + a[1]) for a, b in itertools.pairwise(runs) if a in forwards and b in samplers]
    print(f"{args.model}, {engine.last_step.num_decode_tokens} decoding, {args.steps} traced steps (medians):")
    print(f"  forward {np.median([r[1] for r in forwards]) / 1e6:.2f} ms, sampler (LM head and sampling) "
          f"{np.median([r[1] for r in samplers]) / 1e6:.2f} ms, forward end to sampler start "
          f"{np.median(gaps) / 1e3:.0f} us")
    for kind, ns in parts.items():
        ms = float(np.median(ns)) / 1e6
        rate = f"  {layers * weight_bytes[kind] / ms / 1e6:5.1f} GB/s of weights" if kind in weight_bytes else ""
        lag = ""
        if kind in late:
            v = np.array(late[kind])
            lag = (f"; other thread started after {np.nanmedian(v):.0f} us (p90 {np.nanpercentile(v, 90):.0f}), "
                   f"never in {np.isnan(v).mean():.0%}") if np.isfinite(v).any() else "; other thread never started"
        print(f"  {kind:15s} {ms:6.2f} ms{rate}{lag}")


if __name__ == "__main__":
    main()
