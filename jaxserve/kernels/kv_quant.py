"""A quantized KV pool (`--kv-cache-dtype int8|fp8`): one-byte codes with one float32 scale per token per KV head.

A layer's K (or V) pool is a `QuantizedPool`: codes `[num_pages, page_size, kv_heads, head_dim]` (int8, or fp8
e4m3 `float8_e4m3fn` bits held as uint8) and scales `[num_pages, page_size, kv_heads]` float32, beside them page
for page, so whatever names a page (the page table, the prefix cache, a preempted request's pages) names its
scales too. A row x (one token's KV head) is stored as codes round(x / s) with s = max|x| / code_max (127 for
int8, 448 for e4m3), written by the step's scatter (`write`, quantize on write) and read back as codes * s
inside attention: the jnp reference multiplies at its gather (`rows`), the C++ and Pallas kernels convert codes
in registers and fold s into the scores (K) and the probabilities (V). Per-token scales need no calibration and
bound each row's error by its own range; the price is 4 bytes a row (`modelspec.memory.kv_scale_bytes`), 6% of a
64-wide int8 row.

The pool is a pytree (codes and scales are its leaves), so jit, donation and shardings treat it as two arrays;
`dtype` is the dtype it stands for (the model's, what attention computes in), as a plain pool's `dtype` is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

# fp8 codes are stored as their e4m3fn bits in uint8: XLA's CPU backend runs a scatter into a float8 array by
# converting the whole array to float32 and back, every step (docs/quantization.md has the timing).
CODE_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.uint8)}
CODE_MAX = {"int8": 127.0, "fp8": 448.0}  # the largest code magnitude: max|x| of a row maps onto it


@jax.tree_util.register_dataclass
@dataclass
class QuantizedPool:
    """One layer's K or V pool as codes and per-row scales (module doc)."""

    codes: jax.Array  # [num_pages, page_size, kv_heads, width] int8 / float8_e4m3fn bits as uint8
    scales: jax.Array  # [num_pages, page_size, kv_heads] float32
    dtype: Any = field(default=None, metadata=dict(static=True))  # the dtype it stands for (a pytree meta field)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def sharding(self) -> Any:
        return self.codes.sharding

    @property
    def kind(self) -> str:
        """"int8" or "fp8"."""
        return next(k for k, d in CODE_DTYPES.items() if d == self.codes.dtype)


def kv_kind(pool: Any) -> str:
    """The `--kv-cache-dtype` a layer's pool was built with: "auto" for a plain array."""
    return pool.kind if isinstance(pool, QuantizedPool) else "auto"


def empty_pool(shape: tuple[int, ...], kind: str, dtype: jnp.dtype) -> QuantizedPool:
    """Zeroed codes of `shape` and unit scales (unjitted; `model_builder` allocates pools on their devices)."""
    return QuantizedPool(jnp.zeros(shape, CODE_DTYPES[kind]), jnp.ones(shape[:-1], jnp.float32), jnp.dtype(dtype))


def quantize(x: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """Codes and scales of rows x [..., width]: scale = max|row| / code_max (1 for an all-zero row)."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / CODE_MAX[kind], 1.0)
    y = xf / scale[..., None]
    if kind == "int8":
        codes = jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8)
    else:  # e4m3fn has no infinity: a value past 448 would become NaN, so clip (rounding can reach 448.0x)
        codes = lax.bitcast_convert_type(jnp.clip(y, -448.0, 448.0).astype(jnp.float8_e4m3fn), jnp.uint8)
    return codes, scale


def code_values(codes: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Codes as `dtype` numbers (unscaled): int8 as they are, uint8 read as e4m3fn bits."""
    if codes.dtype == jnp.uint8:
        codes = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    return codes.astype(dtype)


def dequantize(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """Float32 rows from codes [..., width] and their scales [...]."""
    return code_values(codes) * scales[..., None]


def rows(cache: Any, index: Any) -> jax.Array:
    """`cache[index]` read as values: a plain pool's rows as they are, a quantized pool's dequantized (float32)."""
    if isinstance(cache, QuantizedPool):
        return dequantize(cache.codes[index], cache.scales[index])
    return cache[index]


def write(pool: QuantizedPool, x: jax.Array, slot_mapping: jax.Array) -> QuantizedPool:
    """Quantize rows x [T, kv_heads, width] and scatter codes and scales into their slots (page * page_size +
    offset; out-of-range slots dropped)."""
    codes, scales = quantize(x, pool.kind)
    num_pages, page_size, heads, width = pool.codes.shape
    if x.shape[0] == 1:  # one token: an in-place slice update, as `write_kv` does for float pools
        page, at = slot_mapping[0] // page_size, slot_mapping[0] % page_size
        return QuantizedPool(lax.dynamic_update_slice(pool.codes, codes[None], (page, at, 0, 0)),
                             lax.dynamic_update_slice(pool.scales, scales[None], (page, at, 0)), pool.dtype)
    flat_codes = pool.codes.reshape(num_pages * page_size, heads, width).at[slot_mapping].set(codes, mode="drop")
    flat_scales = pool.scales.reshape(num_pages * page_size, heads).at[slot_mapping].set(scales, mode="drop")
    return QuantizedPool(flat_codes.reshape(pool.codes.shape), flat_scales.reshape(pool.scales.shape), pool.dtype)
