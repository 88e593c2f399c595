"""Ragged paged attention for NVIDIA GPUs in Pallas (the Triton flavour): a whole step in one kernel call.

Decodes and prefill chunks of one step go to the same `pallas_call`. The step's query rows are cut into work
items, each `bq` query tokens of one sequence (a decode is one item); the grid is (KV head, work item), so a
program holds the `bq x g` query rows of one KV head's group (GQA/MQA: KV is read once per group, never
repeated) and loops over KV blocks of whole pages with an online softmax: first the blocks every query of the
item sees whole, unmasked, then the ones the causal mask cuts. The loops run inside the kernel, so their
device-side trip counts never reach the host. Which sequence and rows an item covers is planned in jnp before the
call (`_plan`: a cumulative sum and a comparison, no loop); the padded tail of the step is one more "sequence"
with no keys, whose items write the zeros the contract asks for. The step's new KV is already in the pages: the
model's `write_kv` scatter runs before the call.

The design follows tpu-inference's ragged paged attention v3 (its metadata: kv_lens, a page table, cu_q_lens
and the decode/prefill/mixed split, which here is one grid of items rather than three calls) and jax's
deprecated Pallas-Triton paged attention (gathering a block of pages with `k_ref[pages]`, `exp2` with a finite
mask value).

Why Pallas-Triton and not Mosaic GPU, for Hopper too:
- Paging is a gather of pages per KV block. Triton loads through pointers, so a block of scattered pages is one
  load; Mosaic GPU moves tiles with TMA/async copies into shared memory and would need a copy and a barrier per
  page, and its wgmma wants 64-row tiles where a decode has g (1-8) query rows per KV head.
- The same kernel runs on a CPU in interpret mode, which is how CI tests it, and lowers for CUDA without a GPU
  (a Triton custom call in the StableHLO), so the step's loop structure is testable here.
- It runs on Ampere, Ada and Hopper alike (A100, L40S, H100/H200); Mosaic GPU targets Hopper and later.
- The cost: jax deprecates Pallas-Triton in favour of Mosaic GPU. The kernel stays in this file behind the
  `AttentionBackend` interface, so a Mosaic GPU kernel (e.g. for long Hopper prefills, where TMA and wgmma pay)
  can replace it without touching the model.

Constraints (checked by `supports`, at selection time): head_dim and page_size powers of two, head_dim >= 16
(Triton's tensors have power-of-two sizes; query groups are padded up to one); float32, bfloat16 or float16.
Quantized pages (`--kv-cache-dtype int8|fp8`, `kv_quant.QuantizedPool`) are read as codes, converted to the
queries' dtype in registers, with each token's scale on its scores (K) and on its probabilities (V).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.model.attention import kv_quant
from jaxserve.model.attention.metadata import AttentionMetadata

try:  # deprecated since jax 0.11 and to be removed; without it `supports` is False and auto picks the reference
    from jax.experimental.pallas import triton as plgpu
except ImportError:
    plgpu = None

# Finite, so a fully masked row never computes inf - inf (jax's Triton attention kernels use the same value).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)
MIN_ROWS = 16  # Triton's dot needs operands of at least 16 rows and columns
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # the page formats the kernel reads (`--kv-cache-dtype`)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def supports(dtype: jnp.dtype, head_dim: int, page_size: int) -> bool:
    """Whether the kernel can run a model's attention with this KV dtype, head dimension and page size (and
    this jax still has Pallas-Triton)."""
    return (plgpu is not None and jnp.dtype(dtype) in DTYPES and _pow2(head_dim) and head_dim >= 16
            and _pow2(page_size))


def q_block_tokens(num_tokens: int, group: int, block_q: int) -> int:
    """Query tokens per work item for a `num_tokens` step with `group` query heads per KV head: up to `block_q`
    (a power of two), no more than the step needs, and at least MIN_ROWS rows of the padded group."""
    g2 = _next_pow2(group)
    floor = max(1, MIN_ROWS // g2)
    return max(floor, min(_next_pow2(block_q), _next_pow2(num_tokens)))


def max_work_items(num_tokens: int, num_seqs: int, bq: int) -> int:
    """A static bound on the items of a step: sum over non-empty sequences (at most min(T, S), plus the padded
    tail) of ceil(q_len / bq) <= (T + n (bq - 1)) / bq."""
    n = min(num_tokens, num_seqs) + 1
    return max(1, (num_tokens + n * (bq - 1)) // bq)


def _plan(meta: AttentionMetadata, num_tokens: int, bq: int, num_items: int) -> jax.Array:
    """Work items [5, num_items] int32: per item its page-table row, first query row, valid query rows
    (0 for an unused item), the position of its first query and the keys it reads (its causal limit)."""
    s = meta.kv_lens.shape[0]
    seqs = jnp.arange(s)
    real = seqs < meta.num_seqs
    starts = meta.cu_q_lens[:-1]
    q_lens = jnp.where(real, meta.cu_q_lens[1:] - starts, 0)
    kv_lens = jnp.where(real, meta.kv_lens, 0)
    total = meta.cu_q_lens[meta.num_seqs]
    # The padded tail [total, T) is one more sequence with no keys: its items write zeros.
    starts = jnp.concatenate([starts, total[None]])
    q_lens = jnp.concatenate([q_lens, (num_tokens - total)[None]])
    kv_lens = jnp.concatenate([kv_lens, jnp.zeros(1, kv_lens.dtype)])
    blocks = (q_lens + bq - 1) // bq
    ends = jnp.cumsum(blocks)
    item = jnp.arange(num_items)
    seq = jnp.sum(item[:, None] >= ends[None, :], axis=1)  # compare-all: no loop, S+1 past the last item
    live = seq <= s
    seq = jnp.minimum(seq, s)
    blk = item - (ends[seq] - blocks[seq])
    rows = jnp.where(live, jnp.clip(q_lens[seq] - blk * bq, 0, bq), 0)
    row0 = jnp.where(rows > 0, starts[seq] + blk * bq, 0)
    pos0 = jnp.maximum(jnp.where(rows > 0, kv_lens[seq] - q_lens[seq] + blk * bq, 0), 0)  # the tail's: 0
    keys = jnp.where(rows > 0, jnp.minimum(kv_lens[seq], pos0 + rows), 0)
    table_row = jnp.minimum(seq, s - 1)
    return jnp.stack([table_row, row0, rows, pos0, keys]).astype(jnp.int32)


def _kernel(work_ref, q_ref, k_ref, v_ref, *refs, scale: float, bq: int, g2: int, block_pages: int,
            quantized: bool = False):
    """One (KV head, work item): q_ref [T + bq, g2, D], k_ref/v_ref [pages, page_size, D], o_ref like q_ref;
    `quantized`: k_ref/v_ref hold int8/fp8 codes and refs begin with their scales [pages, page_size], folded into
    the scores (K) and the probabilities (V)."""
    ks_ref, vs_ref, table_ref, o_ref = refs if quantized else (None, None, *refs)
    w = pl.program_id(1)
    seq, row0, rows, pos0, keys = (work_ref[i, w] for i in range(work_ref.shape[0]))
    d = q_ref.shape[-1]
    page_size = k_ref.shape[1]
    r, bk = bq * g2, block_pages * page_size
    q = q_ref[pl.ds(row0, bq)].reshape(r, d)  # row i * g2 + j: query token i, head j of the group
    q_pos = pos0 + lax.div(jnp.arange(r, dtype=jnp.int32), g2)

    def body(b, carry, masked: bool):
        acc, m, den = carry
        pages = table_ref[seq, pl.ds(b * block_pages, block_pages)]
        k = k_ref[pages].reshape(bk, d)
        v = v_ref[pages].reshape(bk, d)
        if quantized:  # codes in the queries' dtype, each key's scale on its scores, each value's on its p
            k, v = kv_quant.code_values(k, q.dtype), kv_quant.code_values(v, q.dtype)
            ks, vs = ks_ref[pages].reshape(1, bk), vs_ref[pages].reshape(1, bk)
        s = plgpu.dot(q, k, trans_b=True) * (scale * LOG2E)  # [r, bk] float32, base-2 logits
        if quantized:
            s = s * ks
        if masked:
            t_pos = b * bk + jnp.arange(bk, dtype=jnp.int32)
            s = jnp.where(t_pos[None, :] <= q_pos[:, None], s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        den = den * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot((p * vs if quantized else p).astype(v.dtype), v)
        return acc, m_new, den

    n = lax.div(keys + bk - 1, bk)  # the plan keeps keys and pos0 non-negative
    n_full = jnp.minimum(lax.div(pos0 + 1, bk), n)  # blocks wholly before the item's first query
    carry = (jnp.zeros((r, d), jnp.float32), jnp.full((r,), jnp.finfo(jnp.float32).min, jnp.float32),
             jnp.zeros((r,), jnp.float32))
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    acc, _, den = lax.fori_loop(n_full, n, functools.partial(body, masked=True), carry)
    out = acc / jnp.where(den > 0, den, 1.0)[:, None]  # no keys (padding, unused items): zeros
    keep = jnp.broadcast_to((jnp.arange(bq, dtype=jnp.int32) < rows)[:, None, None], (bq, g2, d))
    plgpu.store(o_ref.at[pl.ds(row0, bq)], out.reshape(bq, g2, d).astype(o_ref.dtype), mask=keep)


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
                           scale: float, *, block_q: int = 16, kv_block: int = 64, num_warps: int = 4,
                           num_stages: int = 2, interpret: bool = False) -> jax.Array:
    """The backend contract (`backend.py`) in one Pallas-Triton call: q [T, H, D], pools [N, page_size, KVH, D]
    (or `kv_quant.QuantizedPool`s of them).

    `block_q`: most query tokens per work item; `kv_block`: keys per inner block (rounded down to a power of two
    of whole pages, at least MIN_ROWS keys); `num_warps`/`num_stages`: Triton's; `interpret`: run the kernel in Pallas'
    interpreter (any platform; tests).
    """
    t, h, d = q.shape
    _, page_size, kvh, _ = k_cache.shape
    quantized = isinstance(k_cache, kv_quant.QuantizedPool)
    pools = (k_cache.codes, v_cache.codes, k_cache.scales, v_cache.scales) if quantized else (k_cache, v_cache)
    g = h // kvh
    g2 = _next_pow2(g)
    bq = q_block_tokens(t, g, block_q)
    # Whole pages, a power of two of them, at least MIN_ROWS keys (Triton's dot is at least 16 wide).
    block_pages = 1 << (max(1, kv_block // page_size, MIN_ROWS // page_size).bit_length() - 1)
    num_items = max_work_items(t, meta.kv_lens.shape[0], bq)
    work = _plan(meta, t, bq, num_items)
    # bq rows of padding keep every item's rows in bounds; the group is padded up to a power of two.
    qg = jnp.pad(q.reshape(t, kvh, g, d), ((0, bq), (0, 0), (0, g2 - g), (0, 0)))
    table = meta.page_table
    if table.shape[1] % block_pages:  # a block's pages are read whole: pad the table to whole blocks (trash page)
        table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % block_pages)))
    rows_spec = pl.BlockSpec((t + bq, pl.squeezed, g2, d), lambda hh, w: (0, hh, 0, 0))
    pool_spec = pl.BlockSpec((k_cache.shape[0], page_size, pl.squeezed, d), lambda hh, w: (0, 0, hh, 0))
    scale_spec = pl.BlockSpec((k_cache.shape[0], page_size, pl.squeezed), lambda hh, w: (0, 0, hh))
    kernel = functools.partial(_kernel, scale=float(scale), bq=bq, g2=g2, block_pages=block_pages,
                               quantized=quantized)
    out = pl.pallas_call(
        kernel,
        grid=(kvh, num_items),
        in_specs=[pl.BlockSpec(work.shape, lambda hh, w: (0, 0)), rows_spec, pool_spec, pool_spec,
                  *((scale_spec, scale_spec) if quantized else ()), pl.BlockSpec(table.shape, lambda hh, w: (0, 0))],
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_bq{bq}_g{g2}_bk{block_pages * page_size}",
    )(work, qg, *pools, table)
    return out[:t, :, :g].reshape(t, h, d)


@dataclass(frozen=True)
class PallasAttention:
    """`ragged_paged_attention` as a backend (see its arguments)."""

    block_q: int = 16
    kv_block: int = 64
    num_warps: int = 4
    num_stages: int = 2
    interpret: bool = False
    name: str = "pallas"

    @property
    def q_blocks(self) -> tuple[int, ...]:
        return (self.block_q,)

    def __call__(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
                 scale: float) -> jax.Array:
        return ragged_paged_attention(q, k_cache, v_cache, meta, scale, block_q=self.block_q,
                                      kv_block=self.kv_block, num_warps=self.num_warps,
                                      num_stages=self.num_stages, interpret=self.interpret)
