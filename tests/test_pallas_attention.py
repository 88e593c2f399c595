"""The Pallas ragged paged attention kernel, run in Pallas' interpreter on the CPU, against the jnp reference and a
dense numpy one: decode-only, prefill-only and mixed steps, GQA groups 1/4/8, pages of 16 and 32 tokens, contexts
ending on and off KV-block boundaries, padded tokens and empty sequences; and the kernel lowered for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.gpu.ragged_paged_attention import PallasAttention, _plan, max_work_items, q_block_tokens, supports
from jaxserve.model.attention.metadata import AttentionMetadata
from jaxserve.model.attention.reference import ACCELERATOR_TUNING

# Small fixed buckets, so each (group, page size, dtype) compiles once; the interpreter is slow.
T_PAD, S_PAD, KV_HEADS, D, KV_BLOCK, MAX_CTX = 64, 8, 2, 32, 32, 128
DECODES = [1, 31, 32, 33, 64, 100, 17]  # on and off the 32-key blocks and the 16/32-token pages
PREFILLS = [(40, 0), (16, 16), (5, 27)]  # (q_len, prior context); 16 + 16 and 5 + 27 end on a block boundary
MIXED = ([32, 7], [(17, 15), (1, 63), (20, 44)])
CASES = {"decode-only": (DECODES, []), "prefill-only": ([], PREFILLS), "mixed": MIXED, "empty": ([], [])}


def build_batch(rng: np.random.Generator, decode_ctx: list[int], prefill: list[tuple[int, int]], page_size: int,
                num_tokens: int = T_PAD) -> dict[str, np.ndarray]:
    """Host arrays of a step padded to (num_tokens, S_PAD): decodes, then prefill chunks, then empty sequences;
    each sequence's pages drawn at random from the pool (page 0, the trash page, left out)."""
    q_lens = [1] * len(decode_ctx) + [q for q, _ in prefill]
    kv_lens = list(decode_ctx) + [q + c for q, c in prefill]
    n, pages_per_seq = len(q_lens), MAX_CTX // page_size
    cu = np.zeros(S_PAD + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kv = np.zeros(S_PAD, np.int32)
    kv[:n] = kv_lens
    pages = rng.permutation(np.arange(1, num_pages(page_size)))
    table = np.zeros((S_PAD, pages_per_seq), np.int32)
    slot = np.arange(num_tokens, dtype=np.int32) % page_size  # padded tokens -> trash page 0
    used = 0
    for s in range(n):
        need = -(-kv_lens[s] // page_size)
        table[s, :need] = pages[used : used + need]
        used += need
        pos = np.arange(kv_lens[s] - q_lens[s], kv_lens[s])
        slot[cu[s] : cu[s + 1]] = table[s, pos // page_size] * page_size + pos % page_size
    return dict(slot_mapping=slot, cu_q_lens=cu, kv_lens=kv, page_table=table, num_seqs=np.int32(n),
                num_decodes=np.int32(len(decode_ctx)))


def num_pages(page_size: int) -> int:
    return 1 + S_PAD * MAX_CTX // page_size


def dense_reference(q, k_cache, v_cache, m, scale) -> np.ndarray:
    """Per-sequence dense causal attention in float64, KV heads repeated."""
    t, h, d = q.shape
    page_size, kvh = k_cache.shape[1], k_cache.shape[2]
    out = np.zeros((t, h, d))
    for s in range(int(m["num_seqs"])):
        lo, hi, kv_len = m["cu_q_lens"][s], m["cu_q_lens"][s + 1], m["kv_lens"][s]
        idx = np.arange(kv_len)
        slots = m["page_table"][s, idx // page_size] * page_size + idx % page_size
        k = np.repeat(k_cache.reshape(-1, kvh, d)[slots].astype(np.float64), h // kvh, axis=1)
        v = np.repeat(v_cache.reshape(-1, kvh, d)[slots].astype(np.float64), h // kvh, axis=1)
        scores = np.einsum("qhd,khd->hqk", q[lo:hi].astype(np.float64), k) * scale
        q_pos = kv_len - (hi - lo) + np.arange(hi - lo)
        scores = np.where(idx[None, None, :] <= q_pos[None, :, None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[lo:hi] = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)
    return out


KERNEL = jax.jit(functools.partial(PallasAttention(kv_block=KV_BLOCK, interpret=True), scale=D**-0.5))


def inputs(rng, group: int, page_size: int, dtype, num_tokens: int = T_PAD):
    shape = (num_pages(page_size), page_size, KV_HEADS, D)
    q = rng.standard_normal((num_tokens, KV_HEADS * group, D), dtype=np.float32)
    k, v = rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)
    # Round to the dtype first so the float64 reference sees the kernel's inputs.
    return [np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v)]


def run(fn, q, k, v, m, dtype):
    meta = AttentionMetadata(**{name: jnp.asarray(x) for name, x in m.items()})
    out = fn(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), meta)
    assert out.dtype == dtype and out.shape == q.shape
    return np.asarray(out.astype(jnp.float32)), meta


# Each configuration compiles the interpreted kernel (seconds): every group size and page size by default, the rest
# of the product marked slow.
FLOAT32_CONFIGS = [(1, 16), (4, 32), (8, 16)] + [pytest.param(g, p, marks=pytest.mark.slow)
                                                 for g, p in ((1, 32), (4, 16), (8, 32))]


@pytest.mark.parametrize(("group", "page_size"), FLOAT32_CONFIGS)
def test_kernel_matches_the_references_float32(group, page_size):
    """Every case through one compiled kernel; the mixed step also against the jnp reference (in two
    configurations: each compile of it takes seconds)."""
    rng = np.random.default_rng(group * 100 + page_size)
    q, k, v = inputs(rng, group, page_size, jnp.float32)
    for name, (decodes, prefills) in CASES.items():
        m = build_batch(rng, decodes, prefills, page_size)
        out, meta = run(KERNEL, q, k, v, m, jnp.float32)
        np.testing.assert_allclose(out, dense_reference(q, k, v, m, D**-0.5), atol=2e-5, rtol=2e-5, err_msg=name)
        n_tok = int(m["cu_q_lens"][-1])
        assert np.all(out[n_tok:] == 0), f"{name}: padded rows must come back as zeros"
        if name == "mixed" and (group, page_size) in ((4, 32), (8, 16)):
            ref = jax.jit(functools.partial(ACCELERATOR_TUNING, scale=D**-0.5))(q, k, v, meta)
            np.testing.assert_allclose(out, np.asarray(ref), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("group", "page_size"), [(8, 32), pytest.param(4, 16, marks=pytest.mark.slow)])
def test_kernel_matches_the_reference_bfloat16(group, page_size):
    rng = np.random.default_rng(7)
    q, k, v = inputs(rng, group, page_size, jnp.bfloat16)
    for name, (decodes, prefills) in CASES.items():
        m = build_batch(rng, decodes, prefills, page_size)
        out, _ = run(KERNEL, q, k, v, m, jnp.bfloat16)
        # Probabilities go to bf16 before P @ V and the output is bf16: a few bf16 ulps.
        np.testing.assert_allclose(out, dense_reference(q, k, v, m, D**-0.5), atol=3e-2, rtol=3e-2, err_msg=name)


def test_one_token_step():
    """The batch-1 decode bucket (T = 1): a decode, a first prompt token, or nothing at all."""
    rng = np.random.default_rng(3)
    q, k, v = inputs(rng, 4, 16, jnp.float32, num_tokens=1)
    for decodes, prefills in (([77], []), ([], [(1, 0)]), ([], [(1, 20)]), ([], [])):
        m = build_batch(rng, decodes, prefills, 16, num_tokens=1)
        out, _ = run(KERNEL, q, k, v, m, jnp.float32)
        np.testing.assert_allclose(out, dense_reference(q, k, v, m, D**-0.5), atol=2e-5, rtol=2e-5)


def test_work_items_cover_every_token_once():
    """The plan: each token row of the step (padding included) falls in exactly one item; unused items are empty
    and never read keys."""
    m = build_batch(np.random.default_rng(0), *MIXED, page_size=16)
    meta = AttentionMetadata(**{name: jnp.asarray(x) for name, x in m.items()})
    bq = q_block_tokens(T_PAD, 4, 16)
    work = np.asarray(_plan(meta, T_PAD, bq, max_work_items(T_PAD, S_PAD, bq)))
    table_row, row0, rows, pos0, keys = work[:5]
    covered = np.concatenate([np.arange(r, r + n) for r, n in zip(row0, rows, strict=True)])
    np.testing.assert_array_equal(np.sort(covered), np.arange(T_PAD))
    assert np.all(keys[rows == 0] == 0) and np.all(pos0 >= 0) and np.all(table_row < S_PAD)


def test_query_blocks_and_item_bounds():
    assert q_block_tokens(1, 4, 16) == 4  # 16 rows: Triton's smallest dot
    assert q_block_tokens(1, 8, 16) == 2 and q_block_tokens(1, 1, 16) == 16
    assert q_block_tokens(8, 4, 16) == 8 and q_block_tokens(2048, 4, 16) == 16
    assert max_work_items(1, 64, 4) == 1
    rng = np.random.default_rng(0)
    for _ in range(200):  # the bound holds for random steps: chunks of any length, then a padded tail
        t, s, bq = int(rng.integers(1, 300)), int(rng.integers(1, 40)), int(rng.choice([1, 2, 4, 8, 16, 32]))
        cuts = np.sort(rng.integers(0, t + 1, size=min(s, t)))
        q_lens = np.diff(np.concatenate([[0], cuts, [t]]))  # the last one: the padded tail
        assert np.sum(-(-q_lens // bq)) <= max_work_items(t, s, bq)


def test_supported_shapes():
    assert supports(jnp.bfloat16, 128, 16) and supports(jnp.float32, 64, 32)
    assert not supports(jnp.bfloat16, 80, 16)  # not a power of two
    assert not supports(jnp.bfloat16, 128, 24) and not supports(jnp.int8, 128, 16)


def lower_for_cuda(fn, *args) -> str:
    """StableHLO of `fn(*args)` lowered for CUDA on this (GPU-less) machine, or a skip saying why not."""
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # a jax without the Triton/CUDA lowering rules
        pytest.skip(f"jax cannot lower Pallas for CUDA here: {type(e).__name__}: {e}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_kernel_lowers_for_cuda_without_a_gpu(dtype):
    """A Triton custom call and nothing else that loops: the kernel's loops live inside it."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(x, dtype) for x in inputs(rng, 4, 16, dtype))
    m = build_batch(rng, *MIXED, page_size=16)
    meta = AttentionMetadata(**{name: jnp.asarray(x) for name, x in m.items()})
    text = lower_for_cuda(functools.partial(PallasAttention(), scale=D**-0.5), q, k, v, meta)
    assert "__gpu$xla.gpu.triton" in text
    assert "stablehlo.while" not in text
