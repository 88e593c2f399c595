"""Weight-only quantization of the linear layers (`--quantization int8|fp8`, vLLM's flag).

Each projection's weight W [in, out...] becomes 8-bit codes Q with one float32 scale per output channel,
symmetric: int8 Q = round(W / s) with s = absmax over the input axis / 127, or fp8 (e4m3, `float8_e4m3fn`)
Q = W / s rounded to the nearest e4m3 value with s = absmax / 448 (e4m3's largest finite value). A checkpoint's
per-tensor scale is kept as a per-channel vector of one value (`compressed_tensors.py`). `QuantizedWeight` holds
(Q, s) as one pytree leaf pair inside the same `nnx.Param`, so every call site of `layers.linear` is unchanged; the
matmul converts Q in the dot's operand and applies s to the output (x @ (Q * s) == (x @ Q) * s per column), so no
float copy of W is kept.
The LM head is quantized too, per vocabulary entry: a tied head gets its own [hidden, vocab] codes (a quarter of the
embedding's bytes) and the embedding stays in the model's float dtype, since it is gathered, not multiplied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    """8-bit codes `q` [in, out...] (int8 or float8_e4m3fn) and float32 scales `scale` [out...]: W ~= q * scale."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def dtype(self) -> jnp.dtype:
        return self.q.dtype

    @property
    def size(self) -> int:
        return int(self.q.size)

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes)

    def __getitem__(self, key: Any) -> QuantizedWeight:
        # `param[...]` is how modules read a weight; any other index would split codes from their scales.
        if key is not Ellipsis:
            raise TypeError("a QuantizedWeight is read whole (w[...])")
        return self

    def reshape(self, *shape: int) -> QuantizedWeight:
        """Reshape the output axes (the input axis, first, must stay): scales follow the codes."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if shape[0] != self.q.shape[0]:
            raise ValueError(f"reshape must keep the input axis {self.q.shape[0]}, got {shape}")
        q = self.q.reshape(shape)
        return QuantizedWeight(q, self.scale.reshape(q.shape[1:]))

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The float weight these codes stand for (tests and references only: the step never builds it)."""
        return (self.q.astype(jnp.float32) * self.scale).astype(dtype)


# The largest code of each format: int8's symmetric range, e4m3's largest finite value.
CODE_MAX = {"int8": 127.0, "fp8": 448.0}
CODE_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}


def channel_scales(w: jax.Array, method: str) -> jax.Array:
    """Per-output-channel scales of `w` [in, out...]: absmax over axis 0 / the format's largest code (1 where a
    column is all zero)."""
    absmax = jnp.max(jnp.abs(jnp.asarray(w, jnp.float32)), axis=0)
    return jnp.where(absmax > 0, absmax / CODE_MAX[method], 1.0).astype(jnp.float32)


def quantize_int8(w: jax.Array) -> QuantizedWeight:
    """Symmetric per-output-channel int8: scale = absmax over axis 0 / 127 (1 where a column is all zero)."""
    scale = channel_scales(w, "int8")
    q = jnp.clip(jnp.round(jnp.asarray(w, jnp.float32) / scale), -127, 127).astype(jnp.int8)
    return QuantizedWeight(q, scale)


def quantize_fp8(w: jax.Array) -> QuantizedWeight:
    """Symmetric per-output-channel fp8 (e4m3): scale = absmax over axis 0 / 448, codes W / scale rounded to the
    nearest e4m3 value (the clip only guards rounding at the edge: |W / scale| <= 448 by construction)."""
    scale = channel_scales(w, "fp8")
    q = jnp.clip(jnp.asarray(w, jnp.float32) / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return QuantizedWeight(q, scale)


QUANTIZERS = {"int8": quantize_int8, "fp8": quantize_fp8}


def method_of(dtype: jnp.dtype) -> str:
    """The `--quantization` name of a code dtype (int8 -> "int8", float8_e4m3fn -> "fp8")."""
    for name, d in CODE_DTYPES.items():
        if jnp.dtype(dtype) == d:
            return name
    raise ValueError(f"no quantization stores codes as {jnp.dtype(dtype)}")


def model_quantization(tree: Any) -> str | None:
    """The `--quantization` name of the codes in a parameter tree, None when nothing is quantized; ValueError when
    it mixes two formats (the planner prices one weight dtype)."""
    is_quantized = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    found = {method_of(w.q.dtype) for w in jax.tree.leaves(tree, is_leaf=is_quantized) if is_quantized(w)}
    if len(found) > 1:
        raise ValueError(f"the model mixes quantized formats {sorted(found)}")
    return found.pop() if found else None


def quantized_matmul(x: jax.Array, w: QuantizedWeight, in_step_order: bool = False) -> jax.Array:
    """x [T, in] @ W [in, out...] with W as 8-bit codes (int8 or fp8): the convert sits in the dot's operand, the
    per-column scale multiplies the output, in x's dtype.

    With `in_step_order` the codes are converted only once x exists, through a factor computed from x that is 1
    exactly (NaN or not): XLA's CPU backend otherwise converts every weight of a step up front, holding a float
    copy of all of them at once; in order it holds one weight's at a time, and runs faster (docs/quantization.md).
    """
    codes = w.q.astype(x.dtype)
    if in_step_order:
        first = x.reshape(-1)[0]
        codes = codes * ((first != first).astype(x.dtype) * 0 + 1)
    y = jax.lax.dot_general(x, codes, (((1,), (0,)), ((), ())))
    return (y * w.scale).astype(x.dtype)


def fp8_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [T, in] @ W [in, out...] with W as fp8 (e4m3) codes and x quantized per token to e4m3 (scale = the row's
    absmax / 448): an fp8 x fp8 product accumulated in float32 (Hopper's fp8 tensor cores), both scales applied to
    the output, in x's dtype."""
    xf = x.astype(jnp.float32)
    x_scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=1, keepdims=True), 1e-12) / CODE_MAX["fp8"]
    xq = (xf / x_scale).astype(jnp.float8_e4m3fn)
    codes = w.q.reshape(w.q.shape[0], -1)
    y = jax.lax.dot_general(xq, codes, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    y = y.reshape(x.shape[0], *w.q.shape[1:])
    return (y * x_scale.reshape(-1, *(1,) * (y.ndim - 1)) * w.scale).astype(x.dtype)


def param_bytes(tree: Any) -> int:
    """Bytes of every array leaf of a parameter tree (codes and scales of quantized weights included)."""
    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(tree) if hasattr(leaf, "nbytes"))
