"""Time the attention of a whole model's layers for decodes beside one small prefill chunk over a long history.

    python scripts/bench_chunk_attention.py                        # 4 decodes + a 16/8/4-token chunk at 4000
    python scripts/bench_chunk_attention.py --chunks 16,4 --q-blocks 128,16
    python scripts/bench_chunk_attention.py --kernel               # the C++ CPU kernel instead of the reference

Unlike `bench_attention.py` (one layer, a pool that just fits, so its KV stays in cache), every layer here has
its own engine-sized pool (`--pool-pages`; the sequences' pages shuffled over its first pages, as
`bench_attention.make_case` lays them out), so each step reads its KV from memory as the engine does. Chunk
sizes are timed in alternating rounds (the machine is shared); each round keeps the best of `--repeat` runs and
the script prints the median over rounds.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import best_time, make_case  # scripts/ is on the path when a script runs

from jaxserve.kernels.cpu.attention_backend import CpuKernelAttention
from jaxserve.model.attention.metadata import AttentionMetadata
from jaxserve.model.attention.paged_attention import DEFAULT_Q_BLOCKS
from jaxserve.model.attention.reference import ReferenceAttention
from modelspec.spec import PRESETS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--chunks", default="16,8,4")
    ap.add_argument("--history", type=int, default=4000)
    ap.add_argument("--decodes", type=int, default=4)
    ap.add_argument("--decode-context", type=int, default=300)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-pages", type=int, default=2048, help="pages per layer (the engine's 1 GiB: ~2700)")
    ap.add_argument("--q-blocks", default=",".join(map(str, DEFAULT_Q_BLOCKS)), help="the jnp reference's")
    ap.add_argument("--kernel", action="store_true", help="time the C++ CPU kernel rather than the jnp reference")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    spec = PRESETS[args.model]
    rng = np.random.default_rng(0)
    shape = (args.pool_pages, args.page_size, spec.num_kv_heads, spec.head_dim)
    caches = [(jnp.asarray(rng.standard_normal(shape, dtype=np.float32)),
               jnp.asarray(rng.standard_normal(shape, dtype=np.float32))) for _ in range(spec.num_layers)]
    backend = CpuKernelAttention() if args.kernel else ReferenceAttention(
        q_block_sizes=tuple(int(b) for b in args.q_blocks.split(",")))
    scale = spec.head_dim**-0.5

    @jax.jit
    def layers(q: jax.Array, caches: list, meta: AttentionMetadata) -> jax.Array:
        out = q
        for k, v in caches:
            out = backend(out, k, v, meta, scale)
        return out

    cases = {}
    for c in (int(x) for x in args.chunks.split(",")):
        seqs = [(1, args.decode_context)] * args.decodes + [(c, args.history + c)]
        q, _, _, meta = make_case(spec, seqs, args.decodes, args.page_size, max_model_len=8192)
        cases[c] = (q, meta)
    rounds: dict[int, list[float]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        for c, (q, meta) in cases.items():
            rounds[c].append(best_time(layers, (q, caches, meta), args.repeat) * 1e3)
    print(f"# {args.model}: {spec.num_layers} layers, {args.decodes} decodes at {args.decode_context}, one chunk "
          f"after {args.history} tokens, pool {args.pool_pages} pages/layer, q_blocks {args.q_blocks}")
    for c, times in rounds.items():
        print(f"chunk {c:>4}: {np.median(times):7.2f} ms (rounds {min(times):.2f}-{max(times):.2f})")


if __name__ == "__main__":
    main()
