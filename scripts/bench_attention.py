"""Benchmark one layer of paged attention (float32, `small` shapes) against the memory/compute floors.

    python scripts/bench_attention.py                       # the standard cases
    python scripts/bench_attention.py --kv-block 512 --q-blocks 64,16 --repeat 20
    python scripts/bench_attention.py --no-kernel             # the jnp reference, not the C++ CPU kernel
    python scripts/bench_attention.py --backend pallas        # the Pallas kernel (on a CPU: interpreted)
    python scripts/bench_attention.py --decodes "" --prefills 4:4096,32:2048 --with-decodes 4 --context 300

Decode: S sequences, each one query token at `--context` tokens of context. Prefill: one chunk of Q tokens
after C tokens of prior context. The page table is padded to ceil(max_model_len / page_size) columns as the
runner pads it. Floors: decode reads S x context x K/V bytes at `--bandwidth`; prefill does 4 x H x D x
(causal query-key pairs) FLOPs at `--flops`. Reports the best of `--repeat` runs (the machine is shared).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.model.attention.reference import ReferenceAttention
from jaxserve.platform.attention_choice import reference_for, select_backend
from modelspec.spec import load_model_spec


def make_case(spec, seqs: list[tuple[int, int]], num_decodes: int, page_size: int, max_model_len: int,
              seed: int = 0):
    """Arrays for sequences given as (q_len, kv_len), pages shuffled over a pool that just fits them."""
    rng = np.random.default_rng(seed)
    h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    need = [-(-kv // page_size) for _, kv in seqs]
    num_pages = sum(need) + 1
    pages = rng.permutation(np.arange(1, num_pages))
    width = -(-max_model_len // page_size)
    table = np.zeros((len(seqs), width), np.int32)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = pages[used : used + n]
        used += n
    q_lens = np.array([q for q, _ in seqs], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1])
    meta = AttentionMetadata(slot_mapping=jnp.zeros(t, jnp.int32), cu_q_lens=jnp.asarray(cu),
                             kv_lens=jnp.asarray([kv for _, kv in seqs], jnp.int32), page_table=jnp.asarray(table),
                             num_seqs=jnp.int32(len(seqs)), num_decodes=jnp.int32(num_decodes))
    q = jnp.asarray(rng.standard_normal((t, h, d), dtype=np.float32))
    k = jnp.asarray(rng.standard_normal((num_pages, page_size, kvh, d), dtype=np.float32))
    v = jnp.asarray(rng.standard_normal((num_pages, page_size, kvh, d), dtype=np.float32))
    return q, k, v, meta


def best_time(fn, args, repeat: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--backend", default="auto", choices=["auto", "reference", "cpu", "pallas"],
                    help="the attention backend, chosen as the engine chooses it")
    ap.add_argument("--no-kernel", action="store_true", help="the same as --backend reference (for A/Bs)")
    ap.add_argument("--kv-block", type=int, default=None, help="reference only; default: its tuning's")
    ap.add_argument("--q-blocks", default=None,
                    help="reference only: query-block sizes, comma-separated (one size: every chunk in blocks of it)")
    ap.add_argument("--decode-kv-block", type=int, default=None, help="reference only")
    ap.add_argument("--decode-tail-block", type=int, default=None, help="reference only")
    ap.add_argument("--decode-mode", default=None, choices=["loop", "batched"], help="reference only")
    ap.add_argument("--with-decodes", type=int, default=0,
                    help="run each prefill chunk beside this many decodes at --context (a mixed step)")
    ap.add_argument("--decodes", default="1,16,32,64")
    ap.add_argument("--prefills", default="256:0,512:0,256:2048,512:2048", help="chunk:prior_context list")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--bandwidth", type=float, default=27e9, help="bytes/s floor for reads")
    ap.add_argument("--flops", type=float, default=120e9, help="FLOP/s floor for matmuls")
    args = ap.parse_args()
    spec = load_model_spec(args.model)  # a preset or a shipped model (bard)
    h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    platform = jax.default_backend()
    backend = select_backend("reference" if args.no_kernel else args.backend, platform, jnp.float32, d,
                             args.page_size)
    if isinstance(backend, ReferenceAttention):
        tuning = {k: v for k, v in dict(
            kv_block=args.kv_block, decode_kv_block=args.decode_kv_block, decode_tail_block=args.decode_tail_block,
            decode_mode=args.decode_mode,
            q_block_sizes=args.q_blocks and tuple(int(b) for b in args.q_blocks.split(","))).items() if v}
        backend = dataclasses.replace(reference_for(platform), **tuning)
    fn = jax.jit(lambda q, k, v, meta: backend(q, k, v, meta, d**-0.5))
    kv_token_bytes = 2 * kvh * d * 4
    print(f"# {args.model}: {h} heads, {kvh} kv heads, head_dim {d}, page {args.page_size}, {backend}, "
          f"platform {platform}")
    print(f"{'case':<28}{'ms/layer':>10}{'floor ms':>10}{'x floor':>9}")
    for s in [int(x) for x in args.decodes.split(",") if x]:
        case = make_case(spec, [(1, args.context)] * s, s, args.page_size, args.max_model_len)
        t = best_time(fn, case, args.repeat)
        floor = s * args.context * kv_token_bytes / args.bandwidth
        print(f"{f'decode {s} x {args.context}':<28}{t * 1e3:>10.3f}{floor * 1e3:>10.3f}{t / floor:>9.1f}")
    for item in [x for x in args.prefills.split(",") if x]:
        q, c = (int(x) for x in item.split(":"))
        n = args.with_decodes
        case = make_case(spec, [(1, args.context)] * n + [(q, q + c)], n, args.page_size, args.max_model_len)
        t = best_time(fn, case, args.repeat)
        pairs = q * c + q * (q + 1) / 2
        floor = max(4 * h * d * (pairs + n * args.context) / args.flops,
                    (q + c + n * args.context) * kv_token_bytes / args.bandwidth)
        label = f"prefill {q} @ {c}" + (f" + {n} decodes" if n else "")
        print(f"{label:<28}{t * 1e3:>10.3f}{floor * 1e3:>10.3f}{t / floor:>9.1f}")


if __name__ == "__main__":
    main()
