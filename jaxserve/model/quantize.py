"""Weight-only int8 quantization of the linear layers (`--quantization int8`, vLLM's flag).

Each projection's weight W [in, out...] becomes int8 codes Q = round(W / s) with one float32 scale per output
channel, s = absmax over the input axis / 127 (symmetric). `QuantizedWeight` holds (Q, s) as one pytree leaf pair
inside the same `nnx.Param`, so every call site of `layers.linear` is unchanged; the matmul converts Q in the dot's
operand and applies s to the output (x @ (Q * s) == (x @ Q) * s per column), so no float copy of W is kept.
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
    """int8 codes `q` [in, out...] and float32 scales `scale` [out...]: W ~= q * scale."""

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


def quantize_int8(w: jax.Array) -> QuantizedWeight:
    """Symmetric per-output-channel int8: scale = absmax over axis 0 / 127 (1 where a column is all zero)."""
    wf = jnp.asarray(w, jnp.float32)
    absmax = jnp.max(jnp.abs(wf), axis=0)
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(wf / scale), -127, 127).astype(jnp.int8)
    return QuantizedWeight(q, scale)


def quantized_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [T, in] @ W [in, out...] with W as int8 codes: the convert sits in the dot's operand, the per-column
    scale multiplies the output, in x's dtype."""
    y = jax.lax.dot_general(x, w.q.astype(x.dtype), (((1,), (0,)), ((), ())))
    return (y * w.scale).astype(x.dtype)


def param_bytes(tree: Any) -> int:
    """Bytes of every array leaf of a parameter tree (codes and scales of quantized weights included)."""
    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(tree) if hasattr(leaf, "nbytes"))
