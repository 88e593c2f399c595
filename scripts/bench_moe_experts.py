"""A decode step's MoE layer: time against the number of distinct experts the batch activates.

One `moe.MoE` layer (router + grouped experts, as the model runs it) on T decode tokens whose routing is forced
to touch exactly n distinct experts: the router is the identity on the first E hidden dimensions and token t's
input is large on the dimensions of the k experts given to it, so top-k picks them. Each n is timed (median of
`--repeats` jitted calls), with the bytes of expert weights it must read and the rate that implies, beside the
same routing through the grouped C++ kernel (all tiles in one call, each expert read in place) and through XLA's
`lax.ragged_dot`; the layer computed densely (every expert on every token, masked) is
the baseline grouped compute avoids.

    python scripts/bench_moe_experts.py --experts 64 --tokens 32 --out reports/moe_experts.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.kernels.cpu import library as cpu_kernels
from jaxserve.model.moe import MoE
from modelspec.spec import PRESETS


def _inputs(tokens: int, k: int, distinct: int, hidden: int, scale: float = 20.0) -> np.ndarray:
    """Rows whose top-k under an identity router are k experts among the first `distinct`, all of them used."""
    x = np.zeros((tokens, hidden), np.float32)
    for t in range(tokens):
        for j in range(k):
            x[t, (t * k + j) % distinct] = scale
    return x


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=1024, help="each expert's intermediate size")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens in the step")
    ap.add_argument("--distinct", default="", help="comma-separated distinct-expert counts (default: powers of 2)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-ragged", action="store_true", help="leave out lax.ragged_dot (slow on a CPU)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    e, k, h = a.experts, a.top_k, a.hidden
    if h < e:
        raise SystemExit("error: --hidden must be at least --experts (the forced router is an identity)")
    spec = dataclasses.replace(PRESETS["tiny-moe"], hidden_size=h, num_experts=e, num_experts_per_tok=k,
                               moe_intermediate_size=a.inter)
    layer = MoE(spec, jnp.float32, nnx.Rngs(0))
    layer.router.set_value(jnp.eye(h, e, dtype=jnp.float32))
    graphdef, params = nnx.split(layer)
    grouped = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))  # XLA's dots in a loop over the tiles
    # all tiles in one call of the grouped C++ kernel, where the CPU kernels are built
    kernel = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x, cpu_kernel=True)) if cpu_kernels.available() else None

    def dense(p, x):  # every expert on every token, weighted by the same routing
        m = nnx.merge(graphdef, p)
        probs = jax.nn.softmax(x @ m.router[...], -1)
        w, ids = jax.lax.top_k(probs, k)
        mask = jnp.zeros((x.shape[0], e)).at[jnp.arange(x.shape[0])[:, None], ids].add(w / w.sum(-1, keepdims=True))
        gu = jnp.einsum("th,ehci->etci", x, m.experts_gate_up[...])
        y = jnp.einsum("eti,eih->eth", jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1], m.experts_down[...])
        return jnp.einsum("te,eth->th", mask, y)

    dense = jax.jit(dense)

    def ragged(p, x):  # the same routing through XLA's ragged_dot over tokens sorted by expert
        m = nnx.merge(graphdef, p)
        probs = jax.nn.softmax(x @ m.router[...], -1)
        w, ids = jax.lax.top_k(probs, k)
        order = jnp.argsort(ids.reshape(-1))
        sizes = jnp.zeros(e, jnp.int32).at[ids.reshape(-1)].add(1)
        xs = x[order // k]
        gu = jax.lax.ragged_dot(xs, m.experts_gate_up[...].reshape(e, h, -1), sizes).reshape(xs.shape[0], 2, -1)
        y = jax.lax.ragged_dot(jax.nn.silu(gu[:, 0]) * gu[:, 1], m.experts_down[...], sizes)
        wn = (w / w.sum(-1, keepdims=True)).reshape(-1)[order]
        return jnp.zeros_like(x).at[order // k].add(y * wn[:, None])

    ragged = jax.jit(ragged)
    counts = [int(c) for c in a.distinct.split(",")] if a.distinct else [
        c for c in (1, 2, 4, 8, 16, 32, 64, 128, 256) if c <= min(e, a.tokens * k) and c >= k]
    expert_bytes = 3 * h * a.inter * 4
    rows = []
    for n in counts:
        x = jnp.asarray(_inputs(a.tokens, k, n, h))
        _, ids = jax.lax.top_k(x @ layer.router[...], k)
        got = len(np.unique(np.asarray(ids)))
        assert got == n, (n, got)
        s = _time(grouped, params, x, repeats=a.repeats)
        kern = _time(kernel, params, x, repeats=a.repeats) if kernel else float("nan")
        r = _time(ragged, params, x, repeats=max(3, a.repeats // 4)) if not a.skip_ragged else float("nan")
        rows.append({"distinct": n, "ms": s * 1e3, "expert_mb": n * expert_bytes / 1e6,
                     "gb_per_s": n * expert_bytes / s / 1e9, "kernel_ms": kern * 1e3,
                     "kernel_gb_per_s": n * expert_bytes / kern / 1e9, "ragged_dot_ms": r * 1e3})
        print(f"distinct experts {n:4d}: {s * 1e3:8.3f} ms  ({n * expert_bytes / 1e6:7.1f} MB of experts, "
              f"{n * expert_bytes / s / 1e9:6.1f} GB/s); grouped kernel {kern * 1e3:8.3f} ms "
              f"({n * expert_bytes / kern / 1e9:6.1f} GB/s); lax.ragged_dot {r * 1e3:8.3f} ms")
    x = jnp.asarray(_inputs(a.tokens, k, counts[-1], h))
    np.testing.assert_allclose(np.asarray(grouped(params, x)), np.asarray(dense(params, x)), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(np.asarray(ragged(params, x)), np.asarray(dense(params, x)), rtol=2e-3, atol=2e-3)
    if kernel:
        np.testing.assert_allclose(np.asarray(kernel(params, x)), np.asarray(dense(params, x)), rtol=2e-3, atol=2e-3)
    dense_s = _time(dense, params, x, repeats=max(3, a.repeats // 4))
    print(f"dense (all {e} experts on every token): {dense_s * 1e3:8.3f} ms")
    fit = np.polyfit([r["distinct"] for r in rows], [r["ms"] for r in rows], 1)
    print(f"fit: {fit[1]:.3f} ms + {fit[0]:.3f} ms per distinct expert")
    result = {"args": vars(a), "rows": rows, "dense_ms": dense_s * 1e3, "device": str(jax.devices()[0]),
              "fit_ms": {"fixed": fit[1], "per_expert": fit[0]}}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
