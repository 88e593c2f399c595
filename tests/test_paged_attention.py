"""Paged attention vs a dense masked reference on random ragged batches (decodes, prefill chunks, padding)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.kernels.cpu import library as cpu_kernels
from jaxserve.kernels.cpu.attention_backend import CpuKernelAttention
from jaxserve.model.attention.metadata import AttentionMetadata
from jaxserve.model.attention.paged_attention import (
    DEFAULT_Q_BLOCKS,
    _block_sizes,
    _cover,
    _wide_block_pages,
    write_kv,
)
from jaxserve.model.attention.reference import ReferenceAttention

jax.config.update("jax_enable_x64", False)

# Fixed bucket shapes so each head configuration compiles once.
T_PAD, S_PAD, PAGES_PER_SEQ, PAGE_SIZE, NUM_PAGES, D = 48, 8, 12, 4, 80, 16


def build_batch(rng: np.random.Generator, decode_ctx: list[int], prefill: list[tuple[int, int]],
                pages_per_seq: int = PAGES_PER_SEQ, num_pages: int = NUM_PAGES):
    """Decodes (context lengths incl. the new token) then prefill chunks (q_len, prior context).

    Returns host arrays of an AttentionMetadata padded to the fixed bucket, with shuffled distinct pages.
    """
    q_lens = [1] * len(decode_ctx) + [q for q, _ in prefill]
    kv_lens = list(decode_ctx) + [q + c for q, c in prefill]
    n = len(q_lens)
    cu = np.zeros(S_PAD + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kv = np.zeros(S_PAD, np.int32)
    kv[:n] = kv_lens
    pages = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((S_PAD, pages_per_seq), np.int32)
    used = 0
    slot = np.zeros(T_PAD, np.int32)  # padded tokens -> trash page 0
    for s in range(n):
        need = -(-kv_lens[s] // PAGE_SIZE)
        table[s, :need] = pages[used : used + need]
        used += need
        pos = np.arange(kv_lens[s] - q_lens[s], kv_lens[s])
        slot[cu[s] : cu[s + 1]] = table[s, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
    return dict(slot_mapping=slot, cu_q_lens=cu, kv_lens=kv, page_table=table, num_seqs=np.int32(n),
                num_decodes=np.int32(len(decode_ctx)))


def dense_reference(q, k_cache, v_cache, m, scale):
    """Per-sequence dense causal attention in numpy (float64), KV heads repeated."""
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    out = np.zeros((t, h, d))
    for s in range(int(m["num_seqs"])):
        lo, hi, kv_len = m["cu_q_lens"][s], m["cu_q_lens"][s + 1], m["kv_lens"][s]
        idx = np.arange(kv_len)
        slots = m["page_table"][s, idx // PAGE_SIZE] * PAGE_SIZE + idx % PAGE_SIZE
        k = k_cache.reshape(-1, kvh, d)[slots].astype(np.float64)
        v = v_cache.reshape(-1, kvh, d)[slots].astype(np.float64)
        k, v = np.repeat(k, h // kvh, axis=1), np.repeat(v, h // kvh, axis=1)
        qs = q[lo:hi].astype(np.float64)
        scores = np.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = kv_len - (hi - lo) + np.arange(hi - lo)
        scores = np.where(idx[None, None, :] <= q_pos[None, :, None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[lo:hi] = np.einsum("hqk,khd->qhd", p, v)
    return out


@functools.cache
def attention_fn(kv_block: int, q_block: int, decode_mode: str):
    """decode_mode "loop" or "batched": the jnp reference's paths; "kernel": the whole step in the C++ CPU kernel."""
    # Blocks of q_block rows, then half and quarter blocks: every chunk length takes a different mix of sizes.
    backend = CpuKernelAttention() if decode_mode == "kernel" else ReferenceAttention(
        kv_block=kv_block, q_block_sizes=(q_block, max(1, q_block // 2), max(1, q_block // 4)),
        decode_kv_block=2 * kv_block, decode_tail_block=PAGE_SIZE, decode_mode=decode_mode)
    return jax.jit(functools.partial(backend, scale=D**-0.5))


def check(rng, heads, kv_heads, decode_ctx, prefill, kv_block=8, q_block=8, decode_mode="loop"):
    m = build_batch(rng, decode_ctx, prefill)
    q = rng.standard_normal((T_PAD, heads, D), dtype=np.float32)
    k_cache = rng.standard_normal((NUM_PAGES, PAGE_SIZE, kv_heads, D), dtype=np.float32)
    v_cache = rng.standard_normal((NUM_PAGES, PAGE_SIZE, kv_heads, D), dtype=np.float32)
    meta = AttentionMetadata(**{k: jnp.asarray(v) for k, v in m.items()})
    fn = attention_fn(kv_block, q_block, decode_mode)
    out = np.asarray(fn(jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), meta))
    ref = dense_reference(q, k_cache, v_cache, m, D**-0.5)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    n_tok = int(m["cu_q_lens"][-1])
    assert np.all(out[n_tok:] == 0), "padded rows must come back as zeros"


HEADS = [(4, 2), (4, 1), (2, 2)]  # GQA, MQA, MHA
MODES = ["loop", "batched", "kernel"]


def test_the_cpu_kernel_builds_here():
    """The machines CI and users run on have a C++ compiler: the kernel must build, or the tests below would
    silently test the jnp path twice."""
    assert cpu_kernels.available()


@pytest.mark.parametrize("decode_mode", MODES)
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_mixed_batch(heads, kv_heads, decode_mode):
    rng = np.random.default_rng(heads * 10 + kv_heads)
    # Two decodes (one at a page boundary), a fresh prefill longer than a q block, a chunk with prior context,
    # and a one-token prefill chunk.
    check(rng, heads, kv_heads, [4, 17], [(11, 0), (9, 13), (1, 6)], decode_mode=decode_mode)
    check(rng, heads, kv_heads, [1, 2, 3, 40, 47, 9, 5, 33], [], decode_mode=decode_mode)
    # Longer chunks: the kernel splits one into tiles of 96 query rows of a KV head (45 tokens: two tiles of
    # 23 and 22 tokens with 4 query heads a KV head; one tile of 90 rows with 2; one of 45 rows with 1).
    check(rng, heads, kv_heads, [7], [(40, 3), (2, 9)], decode_mode=decode_mode)
    check(rng, heads, kv_heads, [], [(45, 2)], decode_mode=decode_mode)


@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_only_decodes_and_only_prefill(heads, kv_heads):
    rng = np.random.default_rng(7)
    check(rng, heads, kv_heads, [1, 2, 3, 40, 47, 9, 5, 33], [])
    check(rng, heads, kv_heads, [], [(20, 27)])
    check(rng, heads, kv_heads, [], [])


def test_block_sizes_do_not_change_result():
    rng = np.random.default_rng(3)
    for kv_block, q_block in [(4, 4), (16, 32), (256, 128), (2048, 128)]:  # 2048: the default off a CPU
        check(rng, 4, 2, [30, 3], [(14, 5), (7, 0)], kv_block=kv_block, q_block=q_block)


def test_small_query_blocks_read_a_long_history_in_wider_kv_blocks():
    # `small`'s shapes: a 4-row chunk (12 query rows a KV head) reads 2048-key blocks, then 512-key ones; a
    # 128-row block (384 rows) reads 1024-key ones; a block whose tile is already WIDE_TILE at 256 keys, or a
    # table narrower than a wide block, gets none.
    assert _wide_block_pages(12, block_pages=16, page_size=16, max_pages=512) == (128, 32)
    assert _wide_block_pages(48, block_pages=16, page_size=16, max_pages=512) == (128, 32)
    assert _wide_block_pages(384, block_pages=16, page_size=16, max_pages=512) == (64,)
    assert _wide_block_pages(1536, block_pages=16, page_size=16, max_pages=512) == ()
    assert _wide_block_pages(12, block_pages=16, page_size=16, max_pages=100) == (32,)


@pytest.mark.parametrize("decode_mode", ["loop", "kernel"])
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS[:2])
def test_small_chunks_over_a_long_history_match_the_reference(heads, kv_heads, decode_mode):
    """Chunks of 1-9 rows after ~600 tokens: every ladder of wide KV blocks, the default blocks after them and
    the masked diagonal block all run (page size 4: 128-, 32- and 8-page blocks before 2-page ones)."""
    rng = np.random.default_rng(11)
    pages_per_seq, num_pages = 200, 700
    fn = attention_fn(8, 8, decode_mode)
    for prefill in ([(1, 600), (3, 517)], [(9, 640), (5, 131), (2, 33)]):
        m = build_batch(rng, [250], prefill, pages_per_seq=pages_per_seq, num_pages=num_pages)
        q = rng.standard_normal((T_PAD, heads, D), dtype=np.float32)
        k_cache = rng.standard_normal((num_pages, PAGE_SIZE, kv_heads, D), dtype=np.float32)
        v_cache = rng.standard_normal((num_pages, PAGE_SIZE, kv_heads, D), dtype=np.float32)
        meta = AttentionMetadata(**{k: jnp.asarray(v) for k, v in m.items()})
        out = np.asarray(fn(jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), meta))
        np.testing.assert_allclose(out, dense_reference(q, k_cache, v_cache, m, D**-0.5), atol=2e-5, rtol=2e-5)


@st.composite
def ragged(draw):
    n_dec = draw(st.integers(0, 4))
    decode_ctx = [draw(st.integers(1, PAGES_PER_SEQ * PAGE_SIZE)) for _ in range(n_dec)]
    prefill = []
    budget = T_PAD - n_dec
    for _ in range(draw(st.integers(0, S_PAD - n_dec))):
        if budget <= 0:
            break
        q = draw(st.integers(1, min(budget, 20)))
        c = draw(st.integers(0, PAGES_PER_SEQ * PAGE_SIZE - q))
        prefill.append((q, c))
        budget -= q
    return decode_ctx, prefill


@pytest.mark.parametrize("decode_mode", MODES)
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS[:2])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=ragged(), seed=st.integers(0, 2**16))
def test_property_random_ragged(heads, kv_heads, decode_mode, batch, seed):
    decode_ctx, prefill = batch
    # Pages must suffice for the whole batch.
    need = sum(-(-c // PAGE_SIZE) for c in decode_ctx) + sum(-(-(q + c) // PAGE_SIZE) for q, c in prefill)
    if need > NUM_PAGES - 1:
        return
    check(np.random.default_rng(seed), heads, kv_heads, decode_ctx, prefill, decode_mode=decode_mode)


@pytest.mark.parametrize("decode_mode", MODES)
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_one_token_step(heads, kv_heads, decode_mode):
    """A one-token step (the batch-1 decode bucket) takes its own path: a decode, a first prompt token, padding."""
    rng = np.random.default_rng(3)
    for decode_ctx, prefill in (([37], []), ([], [(1, 0)]), ([], [(1, 20)]), ([], [])):
        m = build_batch(rng, decode_ctx, prefill)
        m["slot_mapping"] = m["slot_mapping"][:1]
        q = rng.standard_normal((1, heads, D), dtype=np.float32)
        k_cache = rng.standard_normal((NUM_PAGES, PAGE_SIZE, kv_heads, D), dtype=np.float32)
        v_cache = rng.standard_normal((NUM_PAGES, PAGE_SIZE, kv_heads, D), dtype=np.float32)
        meta = AttentionMetadata(**{k: jnp.asarray(v) for k, v in m.items()})
        fn = attention_fn(8, 8, decode_mode)
        out = np.asarray(fn(jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), meta))
        np.testing.assert_allclose(out, dense_reference(q, k_cache, v_cache, m, D**-0.5), atol=2e-5, rtol=2e-5)


def test_write_kv_of_one_token_lands_in_its_slot():
    k_cache, v_cache = jnp.zeros((6, 4, 2, 3)), jnp.zeros((6, 4, 2, 3))
    k, v = jnp.ones((1, 2, 3)), 2 * jnp.ones((1, 2, 3))
    kc, vc = jax.jit(write_kv)(k_cache, v_cache, k, v, jnp.asarray([22], jnp.int32))
    np.testing.assert_array_equal(np.asarray(kc)[5, 2], np.ones((2, 3)))
    np.testing.assert_array_equal(np.asarray(vc)[5, 2], 2 * np.ones((2, 3)))
    assert float(kc.sum()) == 6 and float(vc.sum()) == 12


def test_write_kv_scatters_into_slots():
    rng = np.random.default_rng(0)
    k_cache = jnp.zeros((6, 4, 2, 3))
    v_cache = jnp.zeros((6, 4, 2, 3))
    k = rng.standard_normal((3, 2, 3), dtype=np.float32)
    v = rng.standard_normal((3, 2, 3), dtype=np.float32)
    slots = np.array([21, 5, 0], np.int32)
    kc, vc = jax.jit(write_kv)(k_cache, v_cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(kc)[5, 1], k[0])
    np.testing.assert_array_equal(np.asarray(vc)[1, 1], v[1])
    np.testing.assert_array_equal(np.asarray(kc)[0, 0], k[2])
    assert float(jnp.abs(kc).sum()) == pytest.approx(float(np.abs(k).sum()), rel=1e-6)


@pytest.mark.parametrize("backend", [ReferenceAttention(decode_mode="loop"), ReferenceAttention(decode_mode="batched"),
                                     CpuKernelAttention()])  # the CPU kernel reads the pool in place too
def test_donated_pool_is_updated_in_place(backend):
    """write_kv then attention under a donating jit must not copy the pool (a silent 3x slowdown)."""

    def layer(k_cache, v_cache, q, k, v, meta):
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        return backend(q, k_cache, v_cache, meta, D**-0.5), k_cache, v_cache

    shape = f"f32[{NUM_PAGES},{PAGE_SIZE},2,{D}]"
    for t, batch in ((1, ([5], [])), (T_PAD, ([5, 9], [(6, 3)]))):  # one token: XLA turns the scatter into a DUS
        m = build_batch(np.random.default_rng(0), *batch)
        m["slot_mapping"] = m["slot_mapping"][:t]
        meta = AttentionMetadata(**{k: jnp.asarray(v) for k, v in m.items()})
        pool, new = jnp.zeros((NUM_PAGES, PAGE_SIZE, 2, D)), jnp.ones((t, 2, D))
        hlo = jax.jit(layer, donate_argnums=(0, 1)).lower(pool, pool, jnp.ones((t, 4, D)), new, new,
                                                          meta).compile().as_text()
        copies = [line for line in hlo.splitlines() if " copy(" in line and shape in line]
        assert not copies, copies


@pytest.mark.parametrize(("q_len", "counts"), [
    (4, [0, 0, 0, 1]), (8, [0, 0, 1, 0]), (12, [0, 1, 0, 0]), (16, [0, 1, 0, 0]), (20, [0, 1, 0, 1]),
    (100, [1, 0, 0, 0]), (130, [1, 0, 0, 1]), (0, [0, 0, 0, 0])])
def test_a_chunk_is_covered_by_the_cheapest_mix_of_query_blocks(q_len, counts):
    # A sub-page chunk beside running decodes gets a block of its own size, not a padded 16-row one; a long
    # rest goes in one more large block rather than in many small ones.
    got, _ = _cover(jnp.int32(q_len), DEFAULT_Q_BLOCKS)
    assert [int(c) for c in got] == counts


@given(st.integers(0, 600), st.sampled_from([1, 2, 4, 8, 16, 24, 48, 128, 256]))
def test_query_blocks_cover_every_row_with_less_than_one_block_of_padding(q_len, num_tokens):
    q_len = min(q_len, num_tokens)
    sizes = _block_sizes(DEFAULT_Q_BLOCKS, num_tokens)
    rows = sum(int(c) * b for c, b in zip(_cover(jnp.int32(q_len), sizes)[0], sizes, strict=True))
    assert q_len <= rows < q_len + sizes[0]
    assert max(sizes) <= num_tokens
