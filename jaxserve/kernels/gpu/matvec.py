"""A few-row matmul for GPU decode steps in Pallas (the Triton flavour): y [T, N] = x [T, K] @ W [K, N], T <= 16.

A decode step's projections are matrix-vector products: every weight is read once and used T times, so the
step is bound by how fast W streams from memory. On an H200 XLA lowered two of a one-row step's four projections
to `input_reduce_fusion` + `loop_multiply_fusion` pairs (dot strength reduction), well below the weights' read
time, and int8 and fp8 weights made the step slower than bf16 (docs/results.md, the GPU run of 2026-12-04). This
kernel reads W once, in its stored dtype:

- grid (N tiles, K splits): a program owns `block_n` output columns and one share of K, loops over it in
  `block_k` rows with the weight tile [block_k, block_n] loaded (row-major: contiguous `block_n` codes a row)
  and the x tile [16, block_k] (rows past T masked: Triton's dot needs 16 rows), accumulating in float32;
- int8 / fp8 (e4m3) codes are converted to x's dtype in registers (both exactly representable in bf16) and the
  per-output-channel float32 scales multiply the accumulator once, at the end: one byte a weight from memory;
- with split_k > 1 (too few N tiles to fill the SMs, e.g. N = 2048 gives 16 tiles of 128) each split writes
  a float32 partial [split_k, T, N] and one XLA fusion sums them, scales and casts;
- K and N need not be multiples of the tiles: the last tiles' loads are masked (reading zeros) and their stores
  too, so no padded copy of W is ever made.

Constraints (`matvec_refusal`): 1 <= T <= 16; x float32/bfloat16/float16; W of x's float dtype, or int8 /
float8_e4m3fn codes with scales [N]; fp8 codes need compute capability >= 8.9 (Ada, Hopper), where Triton
converts them; and this jax must still have Pallas-Triton. Float32 dots run at full float32 precision (no TF32):
the kernel is bound by memory, not by its multiplies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.gpu.ragged_paged_attention import MIN_ROWS, _next_pow2, plgpu

H200_SMS = 132
MAX_ROWS = 16  # a decode step's rows; past this many XLA's GEMMs read W once too
X_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CODE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def matvec_refusal(rows: int, k: int, n: int, x_dtype: jnp.dtype, w_dtype: jnp.dtype,
                   compute_capability: float | None = None) -> str | None:
    """Why the kernel cannot multiply x [rows, k] by W [k, n] of `w_dtype` here, or None when it can;
    `compute_capability` (e.g. 9.0; None: unknown, not checked) gates fp8 codes."""
    x_dtype, w_dtype = jnp.dtype(x_dtype), jnp.dtype(w_dtype)
    if plgpu is None:
        return f"this jax ({jax.__version__}) has no Pallas-Triton (jax.experimental.pallas.triton)"
    if not 1 <= rows <= MAX_ROWS:
        return f"it multiplies 1 to {MAX_ROWS} rows, not {rows}"
    if k < 1 or n < 1:
        return f"it needs a non-empty weight, not [{k}, {n}]"
    if x_dtype not in X_DTYPES:
        return f"x must be float32, bfloat16 or float16, not {x_dtype.name}"
    if w_dtype not in CODE_DTYPES and w_dtype != x_dtype:
        return f"W must be int8 or float8_e4m3fn codes or x's dtype {x_dtype.name}, not {w_dtype.name}"
    if w_dtype == jnp.dtype(jnp.float8_e4m3fn) and compute_capability is not None and compute_capability < 8.9:
        return f"fp8 codes need compute capability >= 8.9 (Triton converts them there), not {compute_capability}"
    return None


def matvec_supports(rows: int, k: int, n: int, x_dtype: jnp.dtype, w_dtype: jnp.dtype,
                    compute_capability: float | None = None) -> bool:
    """Whether `matvec` can run this product (see `matvec_refusal`, which says why not)."""
    return matvec_refusal(rows, k, n, x_dtype, w_dtype, compute_capability) is None


@dataclass(frozen=True)
class MatvecTiles:
    """Tiles of one product: output columns and K rows a program loads at a time, and K splits."""

    block_n: int
    block_k: int
    split_k: int


def matvec_tiles(k: int, n: int, w_dtype: jnp.dtype, *, num_sms: int = H200_SMS, waves: float = 2.0,
                 max_split_k: int = 16) -> MatvecTiles:
    """Tiles for W [k, n] of `w_dtype`: 128 columns (256 bytes of a 2-byte row, a 128-byte line of codes; 64 for
    float32), K tiles of 16 KB, and the smallest power-of-two K split that gives >= waves x num_sms programs
    (every SM keeps loads in flight), while each split keeps at least two K tiles to pipeline."""
    size = jnp.dtype(w_dtype).itemsize
    block_n = min(64 if size == 4 else 128, max(MIN_ROWS, _next_pow2(n)))
    block_k = min(max(MIN_ROWS, 16384 // (block_n * size)), max(MIN_ROWS, _next_pow2(k)))
    tiles = -(-n // block_n)
    want = _next_pow2(-(-int(waves * num_sms) // tiles))
    split_k = max(1, min(want, max_split_k, -(-k // (2 * block_k))))
    return MatvecTiles(block_n, block_k, 1 << (split_k.bit_length() - 1))


def _kernel(x_ref, w_ref, *refs, block_n: int, block_k: int, steps: int, scaled: bool, final: bool):
    """One (N tile, K split): x_ref [T, K], w_ref [K, N], scales [N] when `scaled`; o_ref [T, N] (`final`: scaled
    and cast) or a float32 partial [T, N] of this split."""
    s_ref, o_ref = refs if scaled else (None, *refs)
    t, kdim = x_ref.shape
    n = w_ref.shape[1]
    n0 = pl.program_id(0) * block_n  # read outside the loop: the interpreter cannot place program_id in its body
    col = n0 + jnp.arange(block_n, dtype=jnp.int32)
    row = jnp.arange(MIN_ROWS, dtype=jnp.int32)
    k_first = pl.program_id(1) * steps * block_k

    def body(i, acc):
        kk = k_first + i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        x = plgpu.load(x_ref.at[pl.ds(0, MIN_ROWS), pl.ds(k_first + i * block_k, block_k)],
                       mask=(row[:, None] < t) & (kk[None, :] < kdim), other=0)
        inside = (kk[:, None] < kdim) & (col[None, :] < n)
        w = plgpu.load(w_ref.at[pl.ds(k_first + i * block_k, block_k), pl.ds(n0, block_n)], mask=inside)
        # Codes converted in registers; the tail's unloaded lanes zeroed after (Triton has no fp8 `other`).
        w = jnp.where(inside, w.astype(x.dtype), 0)
        precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        return acc + plgpu.dot(x, w, precision=precision)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((MIN_ROWS, block_n), jnp.float32))
    if final and scaled:
        acc = acc * plgpu.load(s_ref.at[pl.ds(n0, block_n)], mask=col < n, other=0)[None, :]
    plgpu.store(o_ref.at[pl.ds(0, MIN_ROWS), pl.ds(n0, block_n)], acc.astype(o_ref.dtype),
                mask=(row[:, None] < t) & (col[None, :] < n))


def matvec(x: jax.Array, w: jax.Array, scales: jax.Array | None = None, *, tiles: MatvecTiles | None = None,
           num_warps: int = 4, num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """x [T, K] @ W [K, N] -> [T, N] in x's dtype, W read once; `scales` [N] float32 when W holds int8 /
    float8_e4m3fn codes (W ~= codes * scales, per output column). `tiles`: `matvec_tiles(K, N, W.dtype)` when
    None. Raises ValueError for a product `matvec_refusal` refuses."""
    t, k = x.shape
    n = w.shape[1]
    quantized = jnp.dtype(w.dtype) in CODE_DTYPES
    why = matvec_refusal(t, k, n, x.dtype, w.dtype)
    if why is None and w.shape[0] != k:
        why = f"x is [{t}, {k}] but W is {list(w.shape)}"
    if why is None and quantized != (scales is not None):
        why = "int8 / fp8 codes need their scales [N], and only codes take scales"
    if why is not None:
        raise ValueError(f"matvec cannot run this product: {why}")
    tiles = tiles or matvec_tiles(k, n, w.dtype)
    steps_total = -(-k // tiles.block_k)
    split_k = min(tiles.split_k, steps_total)
    steps = -(-steps_total // split_k)
    final = split_k == 1
    whole = lambda a: pl.BlockSpec(a.shape, lambda j, s: (0,) * a.ndim)  # noqa: E731
    operands = (x, w, scales.astype(jnp.float32)) if quantized else (x, w)
    if final:
        out_shape = jax.ShapeDtypeStruct((t, n), x.dtype)
        out_spec = pl.BlockSpec((t, n), lambda j, s: (0, 0))
    else:
        out_shape = jax.ShapeDtypeStruct((split_k, t, n), jnp.float32)
        out_spec = pl.BlockSpec((pl.squeezed, t, n), lambda j, s: (s, 0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, block_n=tiles.block_n, block_k=tiles.block_k, steps=steps, scaled=quantized,
                          final=final),
        grid=(-(-n // tiles.block_n), split_k),
        in_specs=[whole(a) for a in operands],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"matvec_{jnp.dtype(w.dtype).name}_n{tiles.block_n}_k{tiles.block_k}_s{split_k}",
    )(*operands)
    if final:
        return out
    y = jnp.sum(out, axis=0)
    return (y * scales.astype(jnp.float32) if quantized else y).astype(x.dtype)
