"""One layer of paged attention (`small`'s shapes) over float32, int8 and fp8 KV pages, alternating in one process.

    python scripts/bench_kv_cache_dtype.py                              # the C++ CPU kernel (auto on a CPU)
    python scripts/bench_kv_cache_dtype.py --backend reference --decodes 16 --context 1024 --prefills 128:1920

Cases: `--decodes` sequences of one query token after `--context` tokens, then each `--prefills` Q:C (a chunk of
Q tokens after C tokens). Every round times each KV dtype once (best of `--repeat` calls) on the same queries and
the same values (the quantized pools hold their codes); the figure per dtype is the median over `--rounds`, and
the ratio to float32 the median of the rounds' ratios (the machine is shared, so alternate rather than sweep).
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
from bench_attention import best_time, make_case  # scripts/ is on the path when a script runs

from jaxserve.model.attention import kv_quant
from jaxserve.model.attention.select import select_backend
from modelspec.spec import PRESETS

KINDS = ("auto", "int8", "fp8")


def pools(k: jax.Array, v: jax.Array, kind: str) -> tuple:
    """The float32 pools as they are, or quantized into `kind` codes and scales."""
    if kind == "auto":
        return k, v
    return tuple(kv_quant.QuantizedPool(*kv_quant.quantize(x, kind), jnp.dtype(jnp.float32)) for x in (k, v))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--backend", default="auto", help="auto, reference, cpu or pallas")
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefills", default="128:1920", help="Q:C,... ('' for none)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    spec = PRESETS[args.model]
    cases = [("decode", [(1, args.context)] * args.decodes, args.decodes)] if args.decodes else []
    for item in filter(None, args.prefills.split(",")):
        q_len, ctx = (int(x) for x in item.split(":"))
        cases.append((f"prefill {q_len} after {ctx}", [(q_len, q_len + ctx)], 0))
    results = {}
    for label, seqs, decodes in cases:
        q, k, v, meta = make_case(spec, seqs, decodes, args.page_size, max(kv for _, kv in seqs))
        fns = {}
        for kind in KINDS:
            backend = select_backend(args.backend, jax.default_backend(), jnp.float32, spec.head_dim, args.page_size,
                                     kv_cache_dtype=kind)
            fns[kind] = (jax.jit(lambda q, kp, vp, m, b=backend: b(q, kp, vp, m, spec.head_dim**-0.5)),
                         (q, *pools(k, v, kind), meta), backend.name)
        times = {kind: [] for kind in KINDS}
        for _ in range(args.rounds):
            for kind, (fn, fn_args, _) in fns.items():
                times[kind].append(best_time(fn, fn_args, args.repeat))
        row = {kind: {"backend": fns[kind][2], "ms": statistics.median(times[kind]) * 1e3,
                      "vs_fp32": statistics.median(t / f for t, f in zip(times[kind], times["auto"], strict=True))}
               for kind in KINDS}
        results[label] = row
        print(f"{label:>24}: " + "  ".join(f"{kind} {r['ms']:.3f} ms ({r['vs_fp32']:.2f}x, {r['backend']})"
                                           for kind, r in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
