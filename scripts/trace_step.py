"""Where a decode step's device time goes, kernel by kernel, from a jax.profiler trace of the engine's steps.

    python scripts/trace_step.py --model small --batch 1
    python scripts/trace_step.py --model small --batch 16 --prompt-len 512
    python scripts/trace_step.py --model small --batch 1 --num-scheduler-steps 8 --steps 6
    python scripts/trace_step.py --model small --prefills 16x128,8x256,4x512,2x1024,1x2048,1x3072

Runs `--batch` requests to steady decode, traces `--steps` engine steps and reads the trace back (XLA's CPU
runtime records every thunk). Prints, per step (medians): the forward's and the sampler's executions, the
forward's time in each kind of kernel call of a layer (the qkv, o, gate/up and down projections with the weight
bandwidth each reached, and attention), in its other thunks and between thunks, the gap between the forward's
end and the sampler's start, and how late XLA's other intra-op thread started on each projection (it sleeps
when idle; a call runs on the calling thread until the other one joins). CPU only, with jaxserve's kernels.

With `--num-scheduler-steps k` above 1 the engine runs k decode steps a dispatch (one program: a loop of forward
and sampler) and the figures are per decode step of those runs: the run's time, each kind of kernel call with its
weight bandwidth, the LM head, XLA's other thunks, the run's idle time and the host's time between runs.

With `--prefills COUNTxTOKENS,...` it traces one prefill step of each case instead (the report's engine, as
`bench_prefill_steps.py` runs it) and splits the forward into the attention kernel's calls and the rest; from
three cases on, it fits attention = a * query-key pairs * layers + b * tokens * layers + c, the split the
planner's step model assumes.
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


SKIP = ("end:", "Threadpool", "ThunkExecutor", "SlinkyThreadPool")  # markers of XLA's runtime, not thunks
Thunk = tuple[int, int, str]  # (start ns, duration ns, name)


def xla_thunks(profile) -> list[Thunk]:
    """Every thunk XLA's CPU runtime ran, on any of its threads, sorted: a program's thunks start on its client
    thread and continue on the intra-op threads after an asynchronous one (a kernel call) completes there."""
    return sorted((e.start_ns, e.duration_ns, e.name) for plane in profile.planes for line in plane.lines
                  if line.name.startswith("tf_XLA") for e in line.events if not e.name.startswith(SKIP))


def executions(profile) -> list[tuple[int, int, list[Thunk]]]:
    """Every executable run, (start ns, duration ns, its thunks), sorted. A run starts where its client thread
    starts executing it and holds every thunk (`xla_thunks`) from then to the next run's start; it lasts to its
    last thunk's end where that is later than the client thread's own span (the program continued elsewhere)."""
    starts = []
    for plane in profile.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLAPjRt"):
                continue
            end = 0
            for e in sorted(line.events, key=lambda e: e.start_ns):
                if e.name == "ThunkExecutor::Execute" and e.start_ns >= end:  # not one nested in a run (a loop's body)
                    starts.append((e.start_ns, e.duration_ns))
                    end = e.start_ns + e.duration_ns
    starts.sort()
    thunks = xla_thunks(profile)
    first = [t[0] for t in thunks]
    runs = []
    for i, (start, dur) in enumerate(starts):
        stop = starts[i + 1][0] if i + 1 < len(starts) else float("inf")
        own = thunks[bisect.bisect_left(first, start):bisect.bisect_left(first, stop)]
        end = max([start + dur] + [t0 + t_dur for t0, t_dur, _ in own])
        runs.append((start, end - start, own))
    return runs


def covered(spans: list[tuple[int, int]]) -> int:
    """The time covered by (start, end) spans, sorted by start."""
    total, reach = 0, None
    for a, b in spans:
        if reach is None or a > reach:
            total, reach = total + b - a, b
        elif b > reach:
            total, reach = total + b - reach, b
    return total


def helper_starts(profile) -> list[int]:
    """When XLA's intra-op threads started a task (ns), sorted."""
    return sorted(e.start_ns for plane in profile.planes for line in plane.lines
                  if line.name.startswith("tf_XLAEigen") for e in line.events
                  if e.name == "ThreadpoolListener::StartRegion")


def traced(step) -> jax.profiler.ProfileData:
    """Run `step()` under jax.profiler and read the trace back. Without jax's Python tracer: it records every
    Python call and slows the host's work between steps (measured in docs/tuning.md)."""
    folder = tempfile.mkdtemp(prefix="jaxserve-trace-")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 1  # XLA's thunks and the threads' regions, annotations; no more
    jax.profiler.start_trace(folder, profiler_options=options)
    step()
    jax.profiler.stop_trace()
    return jax.profiler.ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])


def layer_weight_bytes(spec) -> dict[str, int]:
    """Bytes of float32 weights each projection kind of one layer reads."""
    h, d = spec.hidden_size, spec.head_dim
    return {"qkv": h * (spec.num_heads + 2 * spec.num_kv_heads) * d * 4, "o": spec.num_heads * d * h * 4,
            "gate_up": h * 2 * spec.intermediate_size * 4, "down": spec.intermediate_size * h * 4}


def decode_parts(profile, spec) -> dict:
    """A trace of steady decode steps read back, medians over its steps: the forward's and the sampler's executions,
    the gap between them and between a sampler's end and the next forward's start (the host's work between
    steps), and per kind of a layer's kernel calls its time, the weight bandwidth it reached and how late XLA's
    other intra-op thread joined it; the sampler's LM head (its longest thunk). Projections that ran in XLA's
    dots (the kernel plan declined their row count) count in "other thunks"."""
    weight_bytes = layer_weight_bytes(spec)
    runs = executions(profile)
    layers = spec.num_layers
    # the forward holds a kernel call per layer at least (attention); with the matmul kernel, five
    forwards = [r for r in runs if sum(t[2].startswith("ffi_call") for t in r[2]) >= layers]
    samplers = [r for r in runs if r not in forwards]
    kinds = LAYER_CALLS if all(sum(t[2].startswith("ffi_call") for t in r[2]) >= len(LAYER_CALLS) * layers
                               for r in forwards) else ("attention",)
    parts: dict[str, list[float]] = collections.defaultdict(list)
    late: dict[str, list[float]] = collections.defaultdict(list)
    starts = helper_starts(profile)
    for _, dur, thunks in forwards:
        calls = [t for t in thunks if t[2].startswith("ffi_call")][: len(kinds) * layers]
        per = collections.defaultdict(float)
        for i, (t0, t_dur, _) in enumerate(calls):
            kind = kinds[i % len(kinds)]
            per[kind] += t_dur
            j = bisect.bisect_left(starts, t0)
            if kind != "attention":
                late[kind].append((starts[j] - t0) / 1e3 if j < len(starts) and starts[j] < t0 + t_dur else np.nan)
        per["other thunks"] = sum(t[1] for t in thunks) - sum(t[1] for t in calls)
        per["between thunks"] = dur - sum(t[1] for t in thunks)
        for kind, ns in per.items():
            parts[kind].append(ns)
    pairs = list(itertools.pairwise(runs))
    gaps = [b[0] - (a[0] + a[1]) for a, b in pairs if a in forwards and b in samplers]
    host = [b[0] - (a[0] + a[1]) for a, b in pairs if a in samplers and b in forwards]
    out = {"forward_ms": float(np.median([r[1] for r in forwards])) / 1e6,
           "sampler_ms": float(np.median([r[1] for r in samplers])) / 1e6,
           # the sampler's longest thunk is the LM head (the kernel's call or XLA's dot); the rest is the draw
           "lm_head_ms": float(np.median([max(t[1] for t in r[2]) for r in samplers])) / 1e6,
           "forward_to_sampler_us": float(np.median(gaps)) / 1e3,
           "sampler_to_next_forward_us": float(np.median(host)) / 1e3 if host else float("nan"), "parts": {}}
    for kind, ns in parts.items():
        ms = float(np.median(ns)) / 1e6
        part = {"ms": ms}
        if kind in weight_bytes:
            part["weight_gbps"] = layers * weight_bytes[kind] / ms / 1e6
        if kind in late and np.isfinite(late[kind]).any():
            v = np.array(late[kind])
            part.update(other_thread_us=float(np.nanmedian(v)), other_thread_p90_us=float(np.nanpercentile(v, 90)),
                        other_thread_never=float(np.isnan(v).mean()))
        out["parts"][kind] = part
    return out


def loop_parts(profile, spec, k: int) -> dict:
    """A trace of k-step decode runs (`--num-scheduler-steps k`, steady, no run ending early) read back, per decode
    step (medians over the runs): the run's time, each kind of a layer's kernel calls with its weight bandwidth, the
    LM head (the kernel's call after each step's layers, or else the step's longest other thunk: XLA's dot), XLA's
    other thunks, the run's idle time (no thunk event on any thread: it includes the share of XLA's own
    multi-threaded thunks, such as the head's dot, that runs on after the thunk's event ends) and the host's time
    between runs."""
    layers = spec.num_layers
    calls_a_step = len(LAYER_CALLS) * layers
    runs = [r for r in executions(profile) if sum(t[2].startswith("ffi_call") for t in r[2]) >= k * calls_a_step]
    if not runs:
        raise ValueError(f"no run holds {k} steps' kernel calls: is the engine's --num-scheduler-steps {k}?")
    bytes_of = layer_weight_bytes(spec)
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for _, dur, thunks in runs:
        calls = [t for t in thunks if t[2].startswith("ffi_call")]
        per_step = len(calls) // k
        if per_step not in (calls_a_step, calls_a_step + 1) or len(calls) % k:
            raise ValueError(f"{len(calls)} kernel calls in a run of {k} steps: not {len(LAYER_CALLS)} a layer")
        per = collections.defaultdict(float)
        for i, (_, t_dur, _) in enumerate(calls):
            j = i % per_step
            per[LAYER_CALLS[j % len(LAYER_CALLS)] if j < calls_a_step else "lm_head"] += t_dur
        rest = sorted((t[1] for t in thunks if not t[2].startswith(("ffi_call", "while"))), reverse=True)
        if "lm_head" not in per:  # XLA's dot: each step's longest thunk outside the kernel calls
            per["lm_head"], rest = sum(rest[:k]), rest[k:]
        per["other thunks"] = sum(rest)
        per["idle"] = dur - covered(sorted((t0, t0 + t_dur) for t0, t_dur, name in thunks
                                           if not name.startswith("while")))
        per["run"] = dur
        for kind, ns in per.items():
            parts[kind].append(ns / k)
    host = [b[0] - (a[0] + a[1]) for a, b in itertools.pairwise(runs)]
    out = {"steps_a_run": k, "runs": len(runs),
           "host_between_runs_us": float(np.median(host)) / 1e3 if host else float("nan"), "parts": {}}
    for kind, ns in parts.items():
        part = {"ms": float(np.median(ns)) / 1e6}
        if kind in bytes_of:
            part["weight_gbps"] = layers * bytes_of[kind] / part["ms"] / 1e6
        out["parts"][kind] = part
    return out


def print_loop_parts(res: dict, title: str) -> None:
    print(title)
    print(f"  host between runs {res['host_between_runs_us']:.0f} us ({res['steps_a_run']} steps a run, "
          f"{res['runs']} runs)")
    for kind, part in res["parts"].items():
        print(_part_line(kind, part, "ms a step"))


def _part_line(kind: str, part: dict, unit: str) -> str:
    rate = f"  {part['weight_gbps']:5.1f} GB/s of weights" if "weight_gbps" in part else ""
    return f"  {kind:15s} {part['ms']:6.2f} {unit}{rate}"


def print_decode_parts(res: dict, title: str) -> None:
    print(title)
    print(f"  forward {res['forward_ms']:.2f} ms, sampler {res['sampler_ms']:.2f} ms (LM head "
          f"{res['lm_head_ms']:.2f}), forward end to sampler start {res['forward_to_sampler_us']:.0f} us, "
          f"sampler end to the next forward {res['sampler_to_next_forward_us']:.0f} us")
    for kind, part in res["parts"].items():
        lag = (f"; other thread started after {part['other_thread_us']:.0f} us (p90 {part['other_thread_p90_us']:.0f})"
               f", never in {part['other_thread_never']:.0%}") if "other_thread_us" in part else ""
        print(_part_line(kind, part, "ms") + lag)


def trace_prefills(ap: argparse.ArgumentParser, model: str, cases: list[tuple[int, int]]) -> None:
    """One traced prefill step per case: the forward, its attention calls, the rest; then the attention fit."""
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.kernels.cpu import matmul as cpu_matmul
    from jaxserve.measure.report.context import ReportConfig

    engine = LLMEngine(ReportConfig(model=model).engine_config())
    if any(c * n > engine.config.max_num_batched_tokens or c > engine.config.max_num_seqs for c, n in cases):
        ap.error(f"a case exceeds one step ({engine.config.max_num_batched_tokens} tokens, "
                 f"{engine.config.max_num_seqs} sequences)")
    if any(c * n <= cpu_matmul.MAX_ROWS for c, n in cases):  # their projections are custom calls too
        ap.error(f"a case of at most {cpu_matmul.MAX_ROWS} tokens would count its projections as attention")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)
    layers = engine.spec.num_layers

    def prefill(count: int, n: int) -> None:
        for _ in range(count):
            engine.add_request(f"t{rng.integers(1 << 62)}", rng.integers(1, engine.spec.vocab_size, n).tolist(),
                               params)
        engine.step()

    print(f"{model}, one prefill step per case (the report's engine); the forward's attention calls and the rest:")
    rows = []
    for count, n in cases:
        prefill(count, n)  # an untraced step of the same shape first: the traced one is never its first run
        while engine.has_unfinished_requests():
            engine.step()
        profile = traced(lambda count=count, n=n: prefill(count, n))
        while engine.has_unfinished_requests():
            engine.step()
        _, dur, thunks = max(executions(profile), key=lambda run: run[1])  # the forward: the longest run
        calls = sum(t_dur for _, t_dur, name in thunks if name.startswith("ffi_call"))
        pairs = count * n * (n + 1) / 2
        rows.append((pairs * layers, count * n * layers, calls / 1e6))
        print(f"  {count:3d} x {n:5d}: forward {dur / 1e6:8.1f} ms, attention {calls / 1e6:7.1f} ms, "
              f"the rest {(dur - calls) / 1e6:8.1f} ms")
    if len(rows) >= 3:
        a = np.array([[p, t, 1.0] for p, t, _ in rows])
        y = np.array([ms for *_, ms in rows])
        (per_pair, per_token, const), *_ = np.linalg.lstsq(a, y, rcond=None)
        print(f"  attention ~ {per_pair * 1e6:.2f} ns a pair and layer + {per_token * 1e3:.2f} us a token and layer "
              f"+ {const:.1f} ms; fit against measured: "
              + ", ".join(f"{c}x{n} {f:.0f}/{m:.0f}" for (c, n), f, m in zip(cases, a @ (per_pair, per_token, const),
                                                                                y, strict=True)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prefills", default="", help="COUNTxTOKENS prompts per step, comma separated")
    ap.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="decode steps a dispatch (the engine's flag); above 1, the figures are per step of a run")
    args = ap.parse_args()

    from jaxserve.config.engine import EngineConfig
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.kernels.cpu import library as cpu_kernels

    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        ap.error("this trace reads jaxserve's CPU kernels: it needs a CPU and the kernels built")
    if args.prefills:
        try:
            cases = [(int(c), int(n)) for c, n in (case.split("x") for case in args.prefills.split(","))]
        except ValueError:
            ap.error(f"--prefills takes COUNTxTOKENS,...; got {args.prefills!r}")
        return trace_prefills(ap, args.model, cases)
    k = args.num_scheduler_steps
    if k < 1:
        ap.error(f"--num-scheduler-steps takes a positive count, got {k}")
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=max(16, args.batch), warmup=False,
                                    num_scheduler_steps=k))
    params = SamplingParams(temperature=0, max_tokens=(args.steps + 64) * k, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"p{i}", [(i + j) % 1000 + 1 for j in range(args.prompt_len)], params)
    engine.step()
    while engine.last_step.num_prefill_tokens:
        engine.step()
    for _ in range(5):
        engine.step()
    profile = traced(lambda: [engine.step() for _ in range(args.steps)])

    title = f"{args.model}, {args.batch} decoding, {args.steps} traced engine steps"
    if k > 1:
        return print_loop_parts(loop_parts(profile, engine.spec, k), f"{title} of {k} decode steps (medians):")
    print_decode_parts(decode_parts(profile, engine.spec), f"{title} (medians):")

if __name__ == "__main__":
    main()
