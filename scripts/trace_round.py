"""Where an n-gram speculative round's device time goes against a plain step's, kernel by kernel, from one trace.

    python scripts/trace_round.py --model bard --task copy --requests 4
    python scripts/trace_round.py --model bard --k 4 --output-len 96 --out reports/trace_round.json

Runs `--requests` greedy requests of `bench_speculative.py`'s task (`copy`: a passage and the request to repeat it)
through a synchronous engine with n-gram speculation, one untraced first, and reads a jax.profiler trace of the
others back (XLA's CPU runtime records every thunk). Such an engine runs two kinds of decode step: a round (the
lookup proposed: one program, the target's forward over each sequence's k + 1 rows, its LM head and the rejection
sampler) and a plain step (the lookup found nothing: the forward's program, then the sampler's). Both kinds in one
trace see the same machine. Prints, per kind, medians over its decode steps: each kind of a layer's kernel call
(qkv, attention, o, gate/up, down) summed over the layers, the LM head's call, XLA's other thunks (and the costliest
of them by name), the device span's idle time, the span itself (first thunk to last) and the host's time (the
step's wall time less that span). The round's cost over a plain step's is what `bench_speculative.py`'s TPOT ratio
pays for its drafts. Traced without jax's Python tracer (`trace_step.traced`), so host figures carry only the
profiler's own cost. CPU only, with jaxserve's kernels at both row counts (the kernel plan's choice; the script
says when it is not).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
from trace_step import LAYER_CALLS, Thunk, covered, traced, xla_thunks  # noqa: E402

STEP = "jaxserve-traced-step"  # the annotation around each engine step the script runs
OTHER = "other: "  # a part named so is one kind of XLA thunk, within "other thunks"


def step_windows(profile) -> list[tuple[int, int]]:
    """The annotated steps' windows (start, end ns), sorted."""
    return sorted((e.start_ns, e.start_ns + e.duration_ns) for plane in profile.planes for line in plane.lines
                  for e in line.events if e.name == STEP)


def step_parts(thunks: list[Thunk], layers: int) -> dict[str, float] | None:
    """One decode step's device time by part, in ns: each kind of a layer's kernel call summed over the layers
    (the calls in the model's order), the LM head's call (the last), XLA's other thunks (and, as "other: NAME",
    each kind of them), `idle` (the step's device span less the time some thunk ran) and `span` (first thunk's
    start to last thunk's end). None unless the step made 5 layers + 1 kernel calls (a prefill's projections run
    in XLA's dots)."""
    calls = [t for t in thunks if t[2].startswith("ffi_call")]
    kinds = [kind for _ in range(layers) for kind in LAYER_CALLS] + ["lm_head"]
    if not thunks or len(calls) != len(kinds):
        return None
    per: dict[str, float] = collections.defaultdict(float)
    for (_, dur, _), kind in zip(calls, kinds, strict=True):
        per[kind] += dur
    per["other thunks"] = sum(t[1] for t in thunks) - sum(t[1] for t in calls)
    for _, dur, name in thunks:
        if not name.startswith("ffi_call"):
            per[OTHER + re.sub(r"[.]\d+$", "", name)] += dur  # fusion.3 and fusion.7: one kind
    span = max(t[0] + t[1] for t in thunks) - thunks[0][0]
    per["idle"] = span - covered([(t[0], t[0] + t[1]) for t in thunks])
    per["span"] = span
    return dict(per)


def round_parts(windows: list[tuple[int, int]], kinds: list[str], thunks: list[Thunk], layers: int) -> dict:
    """Rounds against plain decode steps: `windows` the traced steps' (start, end), `kinds` each one's kind
    ("round" or "plain", from the engine), `thunks` every thunk of the trace, sorted. Per kind, medians over its
    decode steps (prefills left out, `step_parts`): `steps`, `parts_us` and `host_us` (the step's wall time less
    its device span); `round_over_plain` per part. ValueError when the windows and kinds disagree in number or
    either kind has no decode step."""
    if len(windows) != len(kinds):
        raise ValueError(f"{len(windows)} traced steps for {len(kinds)} engine steps")
    got: dict[str, list[tuple[dict[str, float], int]]] = {"round": [], "plain": []}
    starts = [t[0] for t in thunks]
    for (a, b), kind in zip(windows, kinds, strict=True):
        inside = thunks[bisect.bisect_left(starts, a): bisect.bisect_left(starts, b)]
        parts = step_parts(inside, layers)
        if parts is not None:
            got[kind].append((parts, b - a))
    if not got["round"] or not got["plain"]:
        raise ValueError(f"the trace holds {len(got['round'])} rounds and {len(got['plain'])} plain decode steps of "
                         f"a {layers}-layer target with 5 x {layers} + 1 kernel calls: it needs both")
    out: dict = {}
    for kind, steps in got.items():
        names = list(dict.fromkeys(name for parts, _ in steps for name in parts))
        out[kind] = {"steps": len(steps),
                     "parts_us": {name: statistics.median(p.get(name, 0.0) for p, _ in steps) / 1e3 for name in names},
                     "host_us": statistics.median(wall - p["span"] for p, wall in steps) / 1e3}
    plain = out["plain"]["parts_us"]
    out["round_over_plain"] = {name: us / plain[name] for name, us in out["round"]["parts_us"].items()
                               if plain.get(name)}
    out["round_over_plain"]["host"] = out["round"]["host_us"] / out["plain"]["host_us"]
    return out


def print_round_parts(res: dict, title: str, other_kinds: int = 6) -> None:
    print(title)
    r, p = res["round"], res["plain"]
    print(f"  {'':34s} {'round':>9s} {'plain':>9s} {'ratio':>6s}")
    others = sorted((name for name in r["parts_us"] if name.startswith(OTHER)), key=lambda n: -r["parts_us"][n])
    rows = []
    for name in (n for n in r["parts_us"] if not n.startswith(OTHER)):
        rows.append((name, r["parts_us"][name], p["parts_us"].get(name, 0.0)))
        if name == "other thunks":  # its costliest kinds in the round beneath it
            rows += [(f"  {n.removeprefix(OTHER)}", r["parts_us"][n], p["parts_us"].get(n, 0.0))
                     for n in others[:other_kinds]]
    rows.append(("host", r["host_us"], p["host_us"]))
    for name, a, b in rows:
        label = "device span" if name == "span" else name
        print(f"  {label:34s} {a:7.0f}us {b:7.0f}us {a / b if b else float('nan'):6.2f}")
    print(f"  ({r['steps']} rounds, {p['steps']} plain decode steps)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bard")
    ap.add_argument("--task", default="copy", choices=["copy", "plain"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--requests", type=int, default=4, help="traced requests, one after another")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from bench_speculative import prompts

    from jaxserve.config.engine import EngineConfig
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.factory import create_engine
    from jaxserve.kernels.cpu import library as cpu_kernels

    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        ap.error("this trace reads jaxserve's CPU kernels: it needs a CPU and the kernels built")
    if a.requests < 1 or a.k < 1:
        ap.error("--requests and --k take a positive count")
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": a.prompt_lookup_max,
            "prompt_lookup_min": a.prompt_lookup_min}
    engine = create_engine(EngineConfig(model=a.model, max_num_seqs=4, max_num_batched_tokens=512, chunk_size=512,
                                        speculative_config=spec))
    ids = prompts(engine, a.prompt_len)[a.task]

    counters, kinds = engine.loop.counters, []

    def run(n: int, record: bool) -> None:
        for i in range(n):
            engine.kv_manager.reset_prefix_cache()
            engine.add_request(f"r{record}-{i}", ids, SamplingParams(temperature=0, max_tokens=a.output_len,
                                                                     ignore_eos=True))
            while engine.has_unfinished_requests():
                rounds = counters.num_drafts  # a synchronous engine's step verifies drafts only as a round
                with jax.profiler.TraceAnnotation(STEP):
                    engine.step()
                if record:
                    kinds.append("round" if counters.num_drafts > rounds else "plain")

    run(1, False)  # untraced: every shape the traced ones run has run once
    profile = traced(lambda: run(a.requests, True))
    try:
        res = round_parts(step_windows(profile), kinds, xla_thunks(profile), engine.spec.num_layers)
    except ValueError as e:
        raise SystemExit(f"error: {e} (the kernel plan may give one of the row counts to XLA's dots)") from None
    print_round_parts(res, f"{a.model}, n-gram k={a.k} on the {a.task} task, {a.requests} traced requests of "
                           f"{a.output_len} tokens (medians):")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"model": a.model, "task": a.task, "k": a.k, **res}, indent=2) + "\n")


if __name__ == "__main__":
    main()
