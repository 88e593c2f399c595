"""Builds one variant of jaxserve's CPU kernels (`cpu_kernels.VARIANTS`), registers it, checks its matmuls and
attention against numpy on the shapes the engine runs, and prints one JSON line.

XLA keeps the first library registered for a target, so each variant runs in a fresh process:
`python tests/cpu_kernel_isa_driver.py avx2 CACHE_DIR`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.cpu import attention as cpu_attention
from jaxserve.kernels.cpu import library as cpu_kernels
from jaxserve.kernels.cpu import matmul as cpu_matmul
from jaxserve.model.attention.metadata import AttentionMetadata

ROWS = (1, 3, 4, 9, 16, 24, 32)  # the engine's buckets up to MAX_ROWS, and counts between passes of rows
PAGE = 16  # tokens a page, as the engine's


def check_matmuls(rng: np.random.Generator) -> list[str]:
    """x @ w for every row count (w's rows in whole and partial blocks, one row in parts) and x @ w^T (rows of w in
    fours and eights, split between threads)."""
    failures = []
    for rows in ROWS:
        for inputs in (37, 64, 600):
            x = rng.standard_normal((rows, inputs), dtype=np.float32)
            w = rng.standard_normal((inputs, 2, 48), dtype=np.float32)
            out = np.asarray(cpu_matmul.cpu_matmul(jnp.asarray(x), jnp.asarray(w)))
            if not np.allclose(out, np.einsum("th,hki->tki", x, w), rtol=1e-4, atol=1e-3):
                failures.append(f"matmul {rows}x{inputs}")
        for w_rows in (40, 1000):
            x = rng.standard_normal((rows, 64), dtype=np.float32)
            w = rng.standard_normal((w_rows, 64), dtype=np.float32)
            out = np.asarray(cpu_matmul.cpu_matmul_nt(jnp.asarray(x), jnp.asarray(w)))
            if not np.allclose(out, x @ w.T, rtol=1e-4, atol=1e-3):
                failures.append(f"matmul_nt {rows}x{w_rows}")
    return failures


def attention_case(rng: np.random.Generator, heads: int, kv_heads: int, dim: int, q_lens: list[int],
                   kv_lens: list[int], tokens: int = 64, seqs: int = 20, width: int = 8) -> str | None:
    """One ragged batch (sequence s: q_lens[s] new tokens, kv_lens[s] keys in all) in pages scattered over a pool,
    against a dense float64 reference; None when it matches."""
    pages = rng.permutation(np.arange(1, seqs * width + 1))
    table = np.zeros((seqs, width), np.int32)
    table[: len(q_lens)] = pages[: len(q_lens) * width].reshape(len(q_lens), width)
    cu = np.zeros(seqs + 1, np.int32)
    cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1 :] = cu[len(q_lens)]
    lens = np.zeros(seqs, np.int32)
    lens[: len(kv_lens)] = kv_lens
    q = rng.standard_normal((tokens, heads, dim), dtype=np.float32)
    k = rng.standard_normal((seqs * width + 1, PAGE, kv_heads, dim), dtype=np.float32)
    v = rng.standard_normal(k.shape, dtype=np.float32)
    meta = AttentionMetadata(slot_mapping=jnp.zeros(tokens, jnp.int32), cu_q_lens=jnp.asarray(cu),
                             kv_lens=jnp.asarray(lens), page_table=jnp.asarray(table),
                             num_seqs=jnp.int32(len(q_lens)), num_decodes=jnp.int32(0))
    scale = dim**-0.5
    out = np.asarray(cpu_attention.cpu_paged_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), meta, scale))
    ref = np.zeros(q.shape)
    for s, (n, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        pos = np.arange(kv_len)
        slots = table[s, pos // PAGE] * PAGE + pos % PAGE
        ks = np.repeat(k.reshape(-1, kv_heads, dim)[slots].astype(np.float64), heads // kv_heads, axis=1)
        vs = np.repeat(v.reshape(-1, kv_heads, dim)[slots].astype(np.float64), heads // kv_heads, axis=1)
        scores = np.einsum("qhd,khd->hqk", q[cu[s] : cu[s] + n].astype(np.float64), ks) * scale
        visible = pos[None, :] <= (kv_len - n + np.arange(n))[:, None]
        scores = np.where(visible[None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        ref[cu[s] : cu[s] + n] = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), vs)
    ok = np.allclose(out, ref, rtol=1e-4, atol=1e-4)
    return None if ok else f"attention h{heads}/{kv_heads} d{dim} q{q_lens} kv{kv_lens}"


def check_attention(rng: np.random.Generator) -> list[str]:
    """One decode, 16 decodes, and a chunk beside decodes (the tile path: its tiles of query rows), for `tiny`'s and
    `small`'s heads."""
    failures = []
    for heads, kv_heads, dim in ((4, 2, 16), (12, 4, 64), (4, 4, 128)):
        cases = [([1], [77]), ([1] * 16, [int(n) for n in rng.integers(1, 120, 16)]),
                 ([1, 1, 40, 2], [5, 100, 53, 9])]
        failures += [f for q_lens, kv_lens in cases
                     if (f := attention_case(rng, heads, kv_heads, dim, q_lens, kv_lens))]
    return failures


def main() -> None:
    variant, cache_dir = sys.argv[1], Path(sys.argv[2])
    t = time.perf_counter()
    library = cpu_kernels.build(cache_dir, variant)
    build_s = time.perf_counter() - t
    assert cpu_kernels.load(cache_dir, variant), "the variant did not build"
    assert jax.default_backend() == "cpu"
    rng = np.random.default_rng(0)
    failures = check_matmuls(rng) + check_attention(rng)
    print(json.dumps({"variant": variant, "isa": cpu_kernels.isa(), "library": library.name, "build_s": build_s,
                      "failures": failures}))


if __name__ == "__main__":
    main()
