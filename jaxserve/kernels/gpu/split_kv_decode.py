"""Split-KV (flash-decoding) attention for the decode rows of a ragged step, in Pallas (the Triton flavour).

`ragged_paged_attention` gives one decode one program per KV head: 8 programs on an H200's 132 SMs for a 1B
model, so one long decode reads its KV far below the memory's bandwidth (docs/results.md, the GPU run of 2026-12-04).
Here a decode's KV blocks are also split across programs: the grid is (KV head, decode, split); each program runs
an online softmax over its share of the decode's blocks and writes a partial (running max m, sum l, unnormalised
accumulator acc, all float32, base-2 logits), and a second pass in jnp (one small XLA fusion) merges the splits:
out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s. A split's share is cut from the
decode's own context (ceil(blocks / splits) blocks each), so long and short decodes of one step are both spread
over every split and an empty split (or a padded decode) costs one program that writes m = -max, l = 0.

Design choices (see docs/attention.md):
- The g query heads of a KV head are one program's rows, padded to MIN_ROWS (Triton's smallest dot): KV is read
  once per group; the padded rows' partials are never written (masked stores), so the partials cost g rows.
- Whole-page KV blocks gathered through the page table (`k_ref[pages]`), as the ragged kernel does; only a
  decode's last block needs the length mask.
- Quantized pools (`kv_quant.QuantizedPool`, int8 or fp8 codes + per-token scales) are read as codes, one byte
  an element, converted to the queries' dtype in registers; K's scales multiply the scores, V's the
  probabilities.
- Mixed steps (`split_kv_step_attention`): the decodes go through this kernel and every other sequence through
  one `ragged_paged_attention` call in which the decodes have no keys; a decode-only step skips that call.

Learned from jax's deprecated `pallas.ops.gpu.paged_attention` (split-K decode with partial (o, l, m) and a jnp
combine; its splits are fixed slices of the page table, ours are per-sequence shares of the real context) and
tpu-inference's ragged paged attention v3 (decode rows first, then the rest of the step).

Constraints: those of `ragged_paged_attention.supports` (power-of-two head_dim >= 16 and page size; float32,
bfloat16 or float16; Pallas-Triton present); page-table entries past a sequence's pages must be valid page
indices (the runner writes 0, the trash page), since a block's pages are gathered whole.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels import kv_quant
from jaxserve.kernels.gpu.ragged_paged_attention import (
    LOG2E,
    MASK_VALUE,
    MIN_ROWS,
    _next_pow2,
    plgpu,
    ragged_paged_attention,
)
from jaxserve.kernels.metadata import AttentionMetadata

H200_SMS = 132  # streaming multiprocessors of an H100 SXM / H200
MAX_SPLITS = 64


def kv_block_pages(kv_block: int, page_size: int) -> int:
    """Pages per KV block: a power of two of whole pages, about `kv_block` keys, at least MIN_ROWS keys."""
    return 1 << (max(1, kv_block // page_size, MIN_ROWS // page_size).bit_length() - 1)


def choose_splits(num_kv_heads: int, num_decodes: int, max_kv_len: int, page_size: int, *, kv_block: int = 64,
                  num_sms: int = H200_SMS, waves: float = 2.0, max_splits: int = MAX_SPLITS) -> int:
    """Splits per decode for a step of `num_decodes` decode rows (a static bound) with contexts up to
    `max_kv_len` keys: the smallest power of two that gives num_kv_heads x num_decodes x splits >= waves x
    num_sms programs (enough to hide memory latency on every SM), capped by the KV blocks of `max_kv_len` (a
    split with no block is a wasted program) and by `max_splits` (the partials are written and re-read)."""
    blocks = -(-max(1, max_kv_len) // (kv_block_pages(kv_block, page_size) * page_size))
    want = -(-int(waves * num_sms) // max(1, num_kv_heads * num_decodes))
    return max(1, min(_next_pow2(want), _next_pow2(blocks), max_splits))


def _kernel(q_ref, k_ref, v_ref, *refs, scale: float, block_pages: int, group: int, quantized: bool):
    """One (KV head, decode, split): q_ref [rows, D] (the group's heads, zero rows past `group`), pools
    [pages, page_size, D] (this KV head), table [decodes, P], lens [decodes] (0 = no keys); writes its partial
    acc [rows, D], m and l [rows] (rows past `group` masked off)."""
    ks_ref, vs_ref, table_ref, lens_ref, o_ref, m_ref, l_ref = refs if quantized else (None, None, *refs)
    dec, split, splits = pl.program_id(1), pl.program_id(2), pl.num_programs(2)
    rows, d = q_ref.shape
    bk = block_pages * k_ref.shape[1]
    q = q_ref[...]
    kv_len = lens_ref[dec]
    n_blocks = lax.div(kv_len + bk - 1, bk)
    share = lax.div(n_blocks + splits - 1, splits)
    start = jnp.minimum(split * share, n_blocks)
    end = jnp.minimum(start + share, n_blocks)
    n_full = jnp.clip(lax.div(kv_len, bk), start, end)  # blocks before it are whole: no mask

    def body(b, carry, masked: bool):
        acc, m, den = carry
        pages = table_ref[dec, pl.ds(b * block_pages, block_pages)]
        k = k_ref[pages].reshape(bk, d)
        v = v_ref[pages].reshape(bk, d)
        if quantized:  # codes in the queries' dtype: one byte an element from memory
            k, v = kv_quant.code_values(k, q.dtype), kv_quant.code_values(v, q.dtype)
        s = plgpu.dot(q, k, trans_b=True) * (scale * LOG2E)  # [rows, bk] float32, base-2 logits
        if quantized:
            s = s * ks_ref[pages].reshape(1, bk)
        if masked:
            t_pos = b * bk + jnp.arange(bk, dtype=jnp.int32)
            s = jnp.where(t_pos[None, :] < kv_len, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # finite: every block holds at least one key
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        den = den * alpha + jnp.sum(p, axis=1)
        if quantized:
            p = p * vs_ref[pages].reshape(1, bk)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, den

    carry = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    carry = lax.fori_loop(start, n_full, functools.partial(body, masked=False), carry)
    acc, m, den = lax.fori_loop(n_full, end, functools.partial(body, masked=True), carry)
    real = jnp.arange(rows, dtype=jnp.int32) < group
    plgpu.store(o_ref, acc, mask=jnp.broadcast_to(real[:, None], (rows, d)))
    plgpu.store(m_ref, m, mask=real)
    plgpu.store(l_ref, den, mask=real)


def combine_splits(acc: jax.Array, m: jax.Array, den: jax.Array) -> jax.Array:
    """Merge partials acc [..., splits, R, D], m and den [..., splits, R] (base-2 running max and sum) over the
    splits axis: [..., R, D] float32; rows no split saw a key of come back as zeros."""
    top = jnp.max(m, axis=-2, keepdims=True)
    w = jnp.exp2(m - top)  # 0 for an empty split beside a real one; 1 everywhere when all are empty (den 0)
    total = jnp.sum(w * den, axis=-2)
    out = jnp.sum(w[..., None] * acc, axis=-3)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def split_kv_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                              kv_lens: jax.Array, num_decodes: jax.Array, scale: float, *, splits: int,
                              kv_block: int = 64, num_warps: int = 4, num_stages: int = 2,
                              interpret: bool = False) -> jax.Array:
    """Attention of one query token per decode over its paged KV, each decode's KV split `splits` ways.

    q [N, H, D]: row i is decode i's query (the step's leading rows, decodes first); pools [num_pages, page_size,
    KVH, D] or `kv_quant.QuantizedPool`s; page_table [>= N, P] and kv_lens [>= N] (context including this step's
    token), row i for decode i; num_decodes [] int32 <= N: rows at and past it are padding. Returns [N, H, D] in
    q's dtype, zeros for padding rows and rows with kv_len 0. `splits`: see `choose_splits`; `kv_block`: keys
    per inner block (whole pages); `interpret`: Pallas' interpreter (any platform; tests).
    """
    n, h, d = q.shape
    _, page_size, kvh, _ = k_pages.shape
    quantized = isinstance(k_pages, kv_quant.QuantizedPool)
    pools = (k_pages.codes, v_pages.codes, k_pages.scales, v_pages.scales) if quantized else (k_pages, v_pages)
    g = h // kvh
    rows = max(MIN_ROWS, _next_pow2(g))
    block_pages = kv_block_pages(kv_block, page_size)
    lens = jnp.where(jnp.arange(n) < num_decodes, kv_lens[:n], 0).astype(jnp.int32)
    table = page_table[:n]
    if table.shape[1] % block_pages:  # blocks read whole pages: pad the table to whole blocks (trash page)
        table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % block_pages)))
    qg = jnp.pad(q.reshape(n, kvh, g, d), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    pool_spec = pl.BlockSpec((k_pages.shape[0], page_size, pl.squeezed, d), lambda hh, i, s: (0, 0, hh, 0))
    scale_spec = pl.BlockSpec((k_pages.shape[0], page_size, pl.squeezed), lambda hh, i, s: (0, 0, hh))
    whole = lambda x: pl.BlockSpec(x.shape, lambda hh, i, s: (0,) * x.ndim)  # noqa: E731
    sq = pl.squeezed
    acc, m, den = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), block_pages=block_pages, group=g, quantized=quantized),
        grid=(kvh, n, splits),
        in_specs=[pl.BlockSpec((sq, sq, rows, d), lambda hh, i, s: (i, hh, 0, 0)), pool_spec, pool_spec,
                  *((scale_spec, scale_spec) if quantized else ()), whole(table), whole(lens)],
        out_specs=[pl.BlockSpec((sq, sq, sq, rows, d), lambda hh, i, s: (i, hh, s, 0, 0)),
                   pl.BlockSpec((sq, sq, sq, rows), lambda hh, i, s: (i, hh, s, 0)),
                   pl.BlockSpec((sq, sq, sq, rows), lambda hh, i, s: (i, hh, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, kvh, splits, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((n, kvh, splits, rows), jnp.float32),
                   jax.ShapeDtypeStruct((n, kvh, splits, rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"split_kv_decode_s{splits}_g{rows}_bk{block_pages * page_size}",
    )(qg, *pools, table, lens)
    # Only the group's real rows are read back (the padded ones were never written).
    out = combine_splits(acc[:, :, :, :g], m[:, :, :, :g], den[:, :, :, :g])
    return out.reshape(n, h, d).astype(q.dtype)


def split_kv_step_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
                            scale: float, *, splits: int, decode_only: bool = False, kv_block: int = 64,
                            block_q: int = 16, prefill_kv_block: int = 64, num_warps: int = 4, num_stages: int = 2,
                            prefill_num_warps: int | None = None, prefill_num_stages: int | None = None,
                            interpret: bool = False) -> jax.Array:
    """A whole ragged step (the `backend.py` contract): its decodes through `split_kv_decode_attention`, every
    other sequence through one `ragged_paged_attention` call in which the decodes have no keys.

    `decode_only`: the caller's promise that every real sequence has one query token (a decode-only compiled
    variant; a one-token step is one by construction), which skips the ragged call. The decode rows are the
    first min(T, S) rows, the most a step can hold.
    """
    t, s = q.shape[0], meta.kv_lens.shape[0]
    n = min(t, s)
    decode_only = decode_only or t == 1
    count = meta.num_seqs if decode_only else meta.num_decodes
    dec = split_kv_decode_attention(q[:n], k_cache, v_cache, meta.page_table, meta.kv_lens, count, scale,
                                    splits=splits, kv_block=kv_block, num_warps=num_warps,
                                    num_stages=num_stages, interpret=interpret)
    if decode_only:
        return jnp.pad(dec, ((0, t - n), (0, 0), (0, 0)))
    rest_meta = dataclasses.replace(meta, kv_lens=jnp.where(jnp.arange(s) < meta.num_decodes, 0, meta.kv_lens))
    rest = ragged_paged_attention(q, k_cache, v_cache, rest_meta, scale, block_q=block_q, kv_block=prefill_kv_block,
                                  num_warps=prefill_num_warps or num_warps,
                                  num_stages=prefill_num_stages or num_stages, interpret=interpret)
    is_decode = (jnp.arange(n) < meta.num_decodes)[:, None, None]
    return rest.at[:n].set(jnp.where(is_decode, dec, rest[:n]))


@dataclass(frozen=True)
class SplitKvAttention:
    """`split_kv_step_attention` as a backend (`backend.py`): the split count is chosen when a step is traced,
    from its static shapes (`choose_splits` with min(T, S) decode rows and the page table's width as the longest
    context). `decode_only` makes the decode-only variant (see `split_kv_step_attention`)."""

    num_sms: int = H200_SMS
    waves: float = 2.0
    kv_block: int = 64
    block_q: int = 16
    prefill_kv_block: int = 64
    num_warps: int = 4
    num_stages: int = 2
    prefill_num_warps: int | None = None  # the prefill items' Triton settings (None: the decode kernel's)
    prefill_num_stages: int | None = None
    decode_only: bool = False
    interpret: bool = False
    name: str = "pallas-split"

    @property
    def q_blocks(self) -> tuple[int, ...]:
        return (self.block_q,)

    def splits_for(self, num_tokens: int, num_kv_heads: int, page_table_shape: tuple[int, int],
                   page_size: int) -> int:
        """The split count a step of these static shapes gets."""
        max_decodes = min(num_tokens, page_table_shape[0])
        return choose_splits(num_kv_heads, max_decodes, page_table_shape[1] * page_size, page_size,
                             kv_block=self.kv_block, num_sms=self.num_sms, waves=self.waves)

    def __call__(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
                 scale: float) -> jax.Array:
        splits = self.splits_for(q.shape[0], k_cache.shape[2], meta.page_table.shape, k_cache.shape[1])
        return split_kv_step_attention(q, k_cache, v_cache, meta, scale, splits=splits, decode_only=self.decode_only,
                                       kv_block=self.kv_block, block_q=self.block_q,
                                       prefill_kv_block=self.prefill_kv_block, num_warps=self.num_warps,
                                       num_stages=self.num_stages, prefill_num_warps=self.prefill_num_warps,
                                       prefill_num_stages=self.prefill_num_stages, interpret=self.interpret)
