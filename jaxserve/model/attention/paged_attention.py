"""Paged attention over a ragged batch in plain jnp: the reference algorithm (`reference.py` is its backend).

Layout of one layer's cache: K and V each `[num_pages, page_size, kv_heads, head_dim]`; page 0 is the trash
page padded tokens write into. Cost is O(sequences x actual context): every loop is bounded by the real KV
lengths, never by the page-table width (which the runner pads to max_model_len) nor by the token count of
other sequences. Query heads are grouped over their KV head (GQA/MQA) so KV is never repeated.

Its loops run to device-side lengths: right on a CPU, but on a GPU each iteration waits for the host to read its
condition, which is why GPUs get the Pallas kernels (`kernels/gpu/`). Block sizes and the decode mode are arguments:
the backend passes a CPU's or an accelerator's tuning (`reference.py`); nothing here looks at the platform.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.kernels import kv_quant
from jaxserve.kernels.metadata import AttentionMetadata

# KV tokens per inner block (rounded to whole pages) and query rows per prefill block.
DEFAULT_KV_BLOCK = 256
# Off a CPU a prefill block reads 2048 keys: XLA's GPU runtime reads each loop iteration's condition back to the
# host, so fewer, wider blocks mean fewer round trips per layer; see docs/tuning.md.
ACCELERATOR_KV_BLOCK = 2048
# Query rows per prefill block, largest first: a chunk is covered by whole blocks of the largest size, then of
# the smaller ones (or one more padded larger block, when cheaper). On a CPU the 8- and 4-row blocks let sub-page
# chunks beside running decodes pay for their own rows only; off a CPU every loop costs a host round trip per layer
# even when it runs no block, so accelerators keep two sizes. See docs/tuning.md.
DEFAULT_Q_BLOCKS = (128, 16, 8, 4)
ACCELERATOR_Q_BLOCKS = (128, 16)
# On a CPU a query block reads the history it sees whole in wider KV blocks: as many keys as keep its score tile at
# 3 x 128 rows x 1024 keys (`small`'s 128-row block with its 3 query heads a KV head), up to 2048, then a quarter
# of that: XLA's CPU dots on a few rows cost mostly their call, so fewer, wider blocks pay it less (docs/tuning.md).
WIDE_TILE = 384 * 1024
WIDE_KV_BLOCK = 2048
DEFAULT_DECODE_KV_BLOCK = 512
# A decode's context past its last whole 512-token block goes in 32-token blocks: 128 read up to 96 masked tokens
# per sequence and layer, and 16-token blocks were slower; see docs/tuning.md.
DEFAULT_DECODE_TAIL_BLOCK = 32
# A query block costs about as much as this many extra query rows (its KV gather and loop), as fitted on a CPU;
# `_cover` makes the same choices across the fitted range. See docs/tuning.md.
Q_BLOCK_OVERHEAD_ROWS = 20


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V [T, kv_heads, head_dim] into their slots (page * page_size + offset); quantized pools
    (`kv_quant.QuantizedPool`) get codes and scales."""
    if isinstance(k_cache, kv_quant.QuantizedPool):
        return kv_quant.write(k_cache, k, slot_mapping), kv_quant.write(v_cache, v, slot_mapping)
    num_pages, page_size, kvh, d = k_cache.shape
    if k.shape[0] == 1:  # one token (the batch-1 decode step): an in-place slice update, cheaper than a scatter
        at = (slot_mapping[0] // page_size, slot_mapping[0] % page_size, 0, 0)
        return (lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype)[None], at),
                lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype)[None], at))
    flat = (num_pages * page_size, kvh, d)
    k_cache = k_cache.reshape(flat).at[slot_mapping].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.reshape(flat).at[slot_mapping].set(v.astype(v_cache.dtype), mode="drop")
    return k_cache.reshape(num_pages, page_size, kvh, d), v_cache.reshape(num_pages, page_size, kvh, d)


def _gather_block(cache: jax.Array, page_row: jax.Array, first_page: jax.Array,
                  block_pages: int) -> jax.Array:
    """KV of `block_pages` pages of one sequence as [block_pages * page_size, kv_heads, head_dim]."""
    pages = lax.dynamic_slice_in_dim(page_row, first_page, block_pages)
    # Gather 4-D pages: reshaping the (just scattered-into) cache to 2-D first makes XLA copy the whole pool
    # on every step.
    return kv_quant.rows(cache, pages).reshape(-1, *cache.shape[2:])


def _online_update(carry: tuple, s: jax.Array, mask: jax.Array, pv: Callable[[jax.Array], jax.Array]) -> tuple:
    """One online-softmax step. s [..., K] float32 scores; mask broadcastable to s; pv(p) = p @ V."""
    m, den, acc = carry
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    den = den * alpha + jnp.sum(p, axis=-1)
    acc = acc * alpha[..., None] + pv(p)
    return m_new, den, acc


def _online_update_unmasked(carry: tuple, s: jax.Array, pv: Callable[[jax.Array], jax.Array]) -> tuple:
    """`_online_update` for a block every query sees whole: scores are finite, no mask, no guards."""
    m, den, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    return m_new, den * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv(p)


def _finish(den: jax.Array, acc: jax.Array) -> jax.Array:
    return jnp.where(den[..., None] > 0, acc / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def _decode_one(q1: jax.Array, k_cache: jax.Array, v_cache: jax.Array, page_row: jax.Array, kv_len: jax.Array,
                scale: float, block_pages: int, tail_pages: int) -> jax.Array:
    """Attention of one query token q1 [kvh, g, d] over its sequence's first kv_len cached tokens.

    Whole blocks of `block_pages` pages first, then the rest in blocks of `tail_pages`: large blocks amortise
    per-iteration overhead on long contexts, small ones keep short contexts from reading a mostly masked block.
    """
    kvh, g, d = q1.shape
    page_size = k_cache.shape[1]
    qf = q1.astype(jnp.float32) * scale

    def step(first_page: jax.Array, pages: int, carry: tuple) -> tuple:
        kb = _gather_block(k_cache, page_row, first_page, pages).astype(jnp.float32)  # [B, kvh, d]
        vb = _gather_block(v_cache, page_row, first_page, pages).astype(jnp.float32)
        # Multiply-and-reduce rather than einsum: XLA fuses the gather into one pass over K (and V) instead of
        # small batched dots with transposes (docs/tuning.md).
        s = jnp.moveaxis(jnp.sum(kb[:, :, None, :] * qf[None], axis=-1), 0, -1)
        mask = (first_page * page_size + jnp.arange(pages * page_size) < kv_len)[None, None, :]
        pv = lambda p: jnp.sum(jnp.moveaxis(p, -1, 0)[..., None] * vb[:, :, None], axis=0)
        return _online_update(carry, s, mask, pv)

    init = (jnp.full((kvh, g), -jnp.inf, jnp.float32), jnp.zeros((kvh, g), jnp.float32),
            jnp.zeros((kvh, g, d), jnp.float32))
    n_big = kv_len // (block_pages * page_size)
    carry = lax.fori_loop(0, n_big, lambda b, c: step(b * block_pages, block_pages, c), init)
    done = n_big * block_pages
    tail = (kv_len - done * page_size + tail_pages * page_size - 1) // (tail_pages * page_size)
    _, den, acc = lax.fori_loop(0, tail, lambda b, c: step(done + b * tail_pages, tail_pages, c), carry)
    return _finish(den, acc)


def _decode_batched(qd: jax.Array, k_cache: jax.Array, v_cache: jax.Array, page_table: jax.Array,
                    kv_lens: jax.Array, scale: float, block_pages: int) -> jax.Array:
    """All decode rows at once, qd [n, kvh, g, d]; loops over KV blocks up to the longest context.

    Cost O(n x longest context) rather than O(sum of contexts), but a handful of large ops per block instead of
    a sequential loop over sequences: the better trade on GPUs, where each small op is a kernel launch.
    Rows with kv_lens 0 come back as zeros.
    """
    n, kvh, g, d = qd.shape
    page_size = k_cache.shape[1]
    block = block_pages * page_size
    qf = qd.astype(jnp.float32) * scale

    def body(b: jax.Array, carry: tuple) -> tuple:
        pages = lax.dynamic_slice_in_dim(page_table, b * block_pages, block_pages, axis=1)  # [n, bp]
        kb = kv_quant.rows(k_cache, pages).reshape(n, block, kvh, d).astype(jnp.float32)
        vb = kv_quant.rows(v_cache, pages).reshape(n, block, kvh, d).astype(jnp.float32)
        s = jnp.einsum("nkgd,ntkd->nkgt", qf, kb)
        mask = (b * block + jnp.arange(block)[None, :] < kv_lens[:, None])[:, None, None, :]
        return _online_update(carry, s, mask, lambda p: jnp.einsum("nkgt,ntkd->nkgd", p, vb))

    init = (jnp.full((n, kvh, g), -jnp.inf, jnp.float32), jnp.zeros((n, kvh, g), jnp.float32),
            jnp.zeros((n, kvh, g, d), jnp.float32))
    _, den, acc = lax.fori_loop(0, (jnp.max(kv_lens) + block - 1) // block, body, init)
    return _finish(den, acc)


def _prefill_block(qb: jax.Array, q_pos0: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                   page_row: jax.Array, kv_len: jax.Array, kv_end: jax.Array, scale: float,
                   block_pages: int, wide_pages: Sequence[int]) -> jax.Array:
    """Causal attention of a query block qb [Bq, kvh, g, d] at positions q_pos0 + i, over KV [0, kv_end).

    Matmuls run in the canonical batched layout, KV head leading and a head's g x Bq query rows merged
    ([kvh, g*Bq, d] against [kvh, t, d]): XLA's CPU dot then needs no per-block transposes of its result, as the
    [Bq, kvh, g, d] einsum did (docs/tuning.md). The history every query sees whole goes first in blocks of each
    of `wide_pages` pages (largest first, as many whole blocks of each as fit), then in blocks of `block_pages` up
    to the diagonal, unmasked; the blocks the causal mask cuts come last.
    """
    bq, kvh, g, d = qb.shape
    page_size = k_cache.shape[1]
    qf = jnp.transpose(qb.astype(jnp.float32) * scale, (1, 2, 0, 3)).reshape(kvh, g * bq, d)
    q_pos = jnp.tile(q_pos0 + jnp.arange(bq), g)  # row r of a head is query r % Bq
    dims_qk = (((2,), (2,)), ((0,), (0,)))
    dims_pv = (((2,), (1,)), ((0,), (0,)))

    def body(first_page: jax.Array, pages: int, carry: tuple, masked: bool) -> tuple:
        kb = jnp.swapaxes(_gather_block(k_cache, page_row, first_page, pages), 0, 1)  # [kvh, t, d]
        vb = jnp.swapaxes(_gather_block(v_cache, page_row, first_page, pages), 0, 1)
        s = lax.dot_general(qf, kb.astype(jnp.float32), dims_qk)  # [kvh, g*Bq, t]
        if masked:
            t_pos = first_page * page_size + jnp.arange(pages * page_size)
            mask = ((t_pos[None, :] <= q_pos[:, None]) & (t_pos[None, :] < kv_len))[None]
            return _online_update(carry, s, mask, lambda p: lax.dot_general(p, vb.astype(jnp.float32), dims_pv))
        return _online_update_unmasked(carry, s, lambda p: lax.dot_general(p, vb.astype(jnp.float32), dims_pv))

    carry = (jnp.full((kvh, g * bq), -jnp.inf, jnp.float32), jnp.zeros((kvh, g * bq), jnp.float32),
             jnp.zeros((kvh, g * bq, d), jnp.float32))
    seen_pages = (q_pos0 + 1) // page_size  # pages wholly before every query: no mask needed
    done = jnp.zeros((), seen_pages.dtype)
    for pages in wide_pages:
        n_wide = (seen_pages - done) // pages
        carry = lax.fori_loop(0, n_wide, lambda b, c, pages=pages, at=done: body(at + b * pages, pages, c, False),
                              carry)
        done = done + n_wide * pages
    block = block_pages * page_size
    n = (kv_end - done * page_size + block - 1) // block
    n_full = jnp.minimum((seen_pages - done) // block_pages, n)
    carry = lax.fori_loop(0, n_full, lambda b, c: body(done + b * block_pages, block_pages, c, False), carry)
    _, den, acc = lax.fori_loop(n_full, n, lambda b, c: body(done + b * block_pages, block_pages, c, True), carry)
    return jnp.transpose(_finish(den, acc).reshape(kvh, g, bq, d), (2, 0, 1, 3))  # [Bq, kvh, g, d]


def _wide_block_pages(rows: int, block_pages: int, page_size: int, max_pages: int) -> tuple[int, ...]:
    """Pages per KV block, largest first, for the history a `rows`-row query block sees whole: as many keys as
    keep its score tile at WIDE_TILE elements (up to WIDE_KV_BLOCK and the table's `max_pages`), then a
    quarter of that, down to above `block_pages`. Empty when `block_pages` is already that wide."""
    pages = min(WIDE_KV_BLOCK, WIDE_TILE // rows) // page_size
    out = []
    while pages > block_pages:
        if pages <= max_pages:
            out.append(pages)
        pages //= 4
    return tuple(out)


def _block_sizes(q_blocks: Sequence[int], num_tokens: int) -> tuple[int, ...]:
    """Query-block sizes a `num_tokens`-token step uses, largest first: none wider than the step."""
    return tuple(sorted({min(b, num_tokens) for b in q_blocks}, reverse=True))


def _cover(q_len: jax.Array, sizes: tuple[int, ...]) -> tuple[list[jax.Array], jax.Array]:
    """How many blocks of each size (largest first) cover `q_len` query rows, and their cost in rows.

    Whole blocks of the largest size, then the rest in smaller ones, unless one more padded block of the larger
    size costs less (a block costs its rows plus Q_BLOCK_OVERHEAD_ROWS).
    """
    b, cost_b = sizes[0], sizes[0] + Q_BLOCK_OVERHEAD_ROWS
    if len(sizes) == 1:
        n = (q_len + b - 1) // b
        return [n], n * cost_b
    n = q_len // b
    rest_counts, rest_cost = _cover(q_len - n * b, sizes[1:])
    pad = rest_cost > cost_b  # zero when nothing is left
    counts = [n + pad.astype(n.dtype)] + [jnp.where(pad, 0, c) for c in rest_counts]
    return counts, (n + pad) * cost_b + jnp.where(pad, 0, rest_cost)


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
                    scale: float, *, kv_block: int = DEFAULT_KV_BLOCK, q_blocks: Sequence[int] = DEFAULT_Q_BLOCKS,
                    decode_kv_block: int = DEFAULT_DECODE_KV_BLOCK, decode_tail_block: int = DEFAULT_DECODE_TAIL_BLOCK,
                    decode_mode: str = "loop", wide_blocks: bool = True) -> jax.Array:
    """Causal attention of ragged queries q [T, H, D] over paged K/V (already holding this step's tokens).

    Decode sequences (the first `num_decodes`, one query each) loop over their own KV blocks
    (`decode_mode="loop"`, O(sum of contexts), best on CPU; `decode_kv_block` tokens per block, the remainder
    in `decode_tail_block` blocks) or go all at once over blocks up to the longest
    context (`"batched"`, fewer and larger ops, for accelerators).
    Prefill chunks loop over query blocks of the `q_blocks` sizes (capped at the step's token count), covering
    each chunk with the least padded work (`_cover`), and, for each block, over `kv_block`-token KV blocks up to
    the causal limit; with `wide_blocks` (a CPU's tuning) the history a block sees whole goes in wider KV blocks
    (`_wide_block_pages`). Rows of padded tokens come back as zeros.
    """
    t, h, d = q.shape
    page_size, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    block_pages = max(1, kv_block // page_size)
    decode_block_pages = max(1, decode_kv_block // page_size)
    tail_pages = max(1, min(decode_block_pages, decode_tail_block // page_size))
    # Pad the page table so a block's dynamic slice never clips (clipping would shift the pages it reads).
    page_table = jnp.pad(meta.page_table, ((0, 0), (0, max(block_pages, decode_block_pages))))
    qg = q.reshape(t, kvh, g, d)
    sizes = _block_sizes(q_blocks, t)
    # A wide block never runs past the table's own pages: it covers history every query sees whole.
    wide_pages = {rows: _wide_block_pages(g * rows, block_pages, page_size, meta.page_table.shape[1])
                  if wide_blocks else () for rows in sizes}
    out = jnp.zeros((t + sizes[0], kvh, g, d), jnp.float32)

    if decode_mode not in ("loop", "batched"):
        raise ValueError(f"decode_mode must be loop or batched, not {decode_mode!r}")
    if t == 1:  # a one-token step is one query at the end of its sequence (or padding, when num_seqs is 0)
        if decode_mode == "batched":
            # One loop over decode_kv_block blocks: on a GPU each loop iteration waits for the host to read its
            # condition, so the per-row loop's extra tail blocks cost round trips there (docs/tuning.md).
            o = _decode_batched(qg[:1], k_cache, v_cache, page_table[:1], meta.kv_lens[:1], scale,
                                decode_block_pages)[0]
        else:
            o = _decode_one(qg[0], k_cache, v_cache, page_table[0], meta.kv_lens[0], scale, decode_block_pages,
                            tail_pages)
        return jnp.where(meta.num_seqs > 0, o, 0.0).reshape(1, h, d).astype(q.dtype)
    if decode_mode == "batched":
        n = min(t, page_table.shape[0])  # decode rows can be at most min(tokens, sequences)
        is_decode = jnp.arange(n) < meta.num_decodes
        o = _decode_batched(qg[:n], k_cache, v_cache, page_table[:n], jnp.where(is_decode, meta.kv_lens[:n], 0),
                            scale, decode_block_pages)
        out = out.at[:n].set(o)
    else:
        def decode_body(s: jax.Array, out: jax.Array) -> jax.Array:
            o = _decode_one(qg[s], k_cache, v_cache, page_table[s], meta.kv_lens[s], scale, decode_block_pages,
                            tail_pages)
            return lax.dynamic_update_slice_in_dim(out, o[None], s, axis=0)

        out = lax.fori_loop(0, meta.num_decodes, decode_body, out)
    out = _prefill_loops(qg, k_cache, v_cache, meta, page_table, out, scale, sizes, block_pages, wide_pages)
    return out.reshape(t, h, d).astype(q.dtype)


def _prefill_loops(qg: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
                   page_table: jax.Array, out: jax.Array, scale: float, sizes: tuple[int, ...], block_pages: int,
                   wide_pages: dict[int, tuple[int, ...]]) -> jax.Array:
    """Write the attention of every prefill chunk into out [T + sizes[0], kvh, g, d] (decode rows keep what `out`
    holds); returns its first T rows."""
    t = qg.shape[0]
    q_pad = jnp.pad(qg, ((0, sizes[0]), (0, 0), (0, 0), (0, 0)))

    def prefill_seq(s: jax.Array, out: jax.Array) -> jax.Array:
        q_start, q_end = meta.cu_q_lens[s], meta.cu_q_lens[s + 1]
        q_len, kv_len = q_end - q_start, meta.kv_lens[s]
        ctx = kv_len - q_len  # position of the first query token
        page_row = page_table[s]

        def in_blocks(rows: int, first: jax.Array, count: jax.Array, out: jax.Array) -> jax.Array:
            """`count` blocks of `rows` query rows, from the chunk's row `first` on."""
            def qblock_body(i: jax.Array, out: jax.Array) -> jax.Array:
                r0 = first + i * rows
                row0 = q_start + r0
                qb = lax.dynamic_slice_in_dim(q_pad, row0, rows, axis=0)
                kv_end = jnp.minimum(kv_len, ctx + r0 + rows)
                o = _prefill_block(qb, ctx + r0, k_cache, v_cache, page_row, kv_len, kv_end, scale, block_pages,
                                  wide_pages[rows])
                old = lax.dynamic_slice_in_dim(out, row0, rows, axis=0)
                keep = (row0 + jnp.arange(rows) < q_end)[:, None, None, None]
                return lax.dynamic_update_slice_in_dim(out, jnp.where(keep, o, old), row0, axis=0)

            return lax.fori_loop(0, count, qblock_body, out)

        first = jnp.zeros((), q_len.dtype)
        for rows, count in zip(sizes, _cover(q_len, sizes)[0], strict=True):
            out = in_blocks(rows, first, count, out)
            first = first + count * rows
        return out

    return lax.fori_loop(meta.num_decodes, meta.num_seqs, prefill_seq, out)[:t]
