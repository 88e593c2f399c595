"""Matmuls of a few rows on a CPU (`matmul.cc`), called through jax.ffi: x @ w, and x @ w^T for a tied LM head.

A decode step's projections are x [T, in] @ w [in, out] with T the number of decodes: reading w once is the
floor, and XLA's CPU dots ran them at a fraction of it (docs/tuning.md). From MAX_ROWS rows on, XLA's GEMM
(YNNPACK) is as fast or faster and keeps them; below, the engine's kernel plan (`kernel_choice`) keeps the row
counts where XLA was measured faster on this machine. Built with the other CPU kernels (`cpu_kernels`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.cpu import library as cpu_kernels

TARGET = "jaxserve_matmul"
TARGET_NT = "jaxserve_matmul_nt"
TARGET_GROUPED = "jaxserve_grouped_matmul"
# Rows up to which the kernel beat XLA's dots on `small`'s matrices (the plan's candidates); see docs/tuning.md.
MAX_ROWS = 32


def supports(x: jax.Array, w: jax.Array) -> bool:
    """Whether the kernel can take x [T, in] @ w [in, ...]: float32 on a CPU, at most MAX_ROWS rows, whole
    16-float vectors of output columns."""
    out = w.size // max(1, w.shape[0])
    return (x.dtype == jnp.float32 and w.dtype == jnp.float32
            and x.ndim == 2 and 1 <= x.shape[0] <= MAX_ROWS and out % 16 == 0 and cpu_kernels.available())


def cpu_matmul(x: jax.Array, w: jax.Array, row_parts: int = 0) -> jax.Array:
    """x [T, in] @ w [in, ...] -> [T, ...] (float32), w read as the [in, out] matrix it is in memory. One row of x
    cuts w's rows into at most `row_parts` contiguous parts the threads claim (0: the kernel's default, 16)."""
    if not cpu_kernels.available():
        raise RuntimeError("jaxserve's CPU kernels are not available on this machine (see the warning above)")
    w2 = w.reshape(w.shape[0], -1)
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w2.shape[1]), jnp.float32))(
        x, w2, row_parts=np.int32(row_parts))
    return y.reshape(x.shape[0], *w.shape[1:])


def supports_nt(x: jax.Array, w: jax.Array) -> bool:
    """Whether the kernel can take x [T, K] @ w [N, K]^T: float32 on a CPU, at most MAX_ROWS rows, K in whole
    16-float vectors and N in whole groups of 4 rows."""
    return (x.dtype == jnp.float32 and w.dtype == jnp.float32
            and x.ndim == 2 and w.ndim == 2 and 1 <= x.shape[0] <= MAX_ROWS and w.shape[1] % 16 == 0
            and w.shape[0] % 4 == 0 and cpu_kernels.available())


def cpu_matmul_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, K] @ w [N, K]^T -> [T, N] (float32): a tied LM head over the embedding as it lies in memory."""
    if not cpu_kernels.available():
        raise RuntimeError("jaxserve's CPU kernels are not available on this machine (see the warning above)")
    return jax.ffi.ffi_call(TARGET_NT, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))(x, w)


def supports_grouped(x: jax.Array, w: jax.Array) -> bool:
    """Whether the kernel can take the MoE tiles x [tiles * R, K] against experts w [E, K, ...]: float32 on a CPU,
    whole 16-float vectors of output columns."""
    out = w.size // max(1, w.shape[0] * w.shape[1])
    return (x.dtype == jnp.float32 and w.dtype == jnp.float32
            and x.ndim == 2 and w.ndim >= 3 and out % 16 == 0 and cpu_kernels.available())


def cpu_grouped_matmul(x: jax.Array, w: jax.Array, tile_expert: jax.Array, tile_rows: jax.Array) -> jax.Array:
    """Rows [j R, (j + 1) R) of x [tiles * R, K] times expert tile_expert[j] of w [E, K, ...] -> [tiles * R, ...],
    only the first tile_rows[j] rows of each tile computed (the others zero); each expert read once, in place."""
    if not cpu_kernels.available():
        raise RuntimeError("jaxserve's CPU kernels are not available on this machine (see the warning above)")
    w3 = w.reshape(w.shape[0], w.shape[1], -1)
    y = jax.ffi.ffi_call(TARGET_GROUPED, jax.ShapeDtypeStruct((x.shape[0], w3.shape[2]), jnp.float32))(
        x, w3, tile_expert.astype(jnp.int32), tile_rows.astype(jnp.int32))
    return y.reshape(x.shape[0], *w.shape[2:])
