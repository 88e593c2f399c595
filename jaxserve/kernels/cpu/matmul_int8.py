"""x @ W for int8 weight codes with per-column scales on a CPU (`matmul_int8.cc`), called through jax.ffi.

The codes are converted to floats in registers and the scales applied as each column is stored, so a decode
step reads a quarter of float32's weight bytes; XLA's own dot over `q.astype(f32)` materialised the converted
weight every step instead (docs/quantization.md). Built with the other CPU kernels (`cpu_kernels`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.cpu import library as cpu_kernels
from jaxserve.kernels.cpu.matmul import MAX_ROWS

TARGET = "jaxserve_matmul_int8"
TILE = 64  # output columns a kernel tile takes under AVX-512 (narrower ISAs' tiles divide it)


def supports(x: jax.Array, q: jax.Array) -> bool:
    """Whether the kernel can take x [T, in] @ codes q [in, ...]: float32 x and int8 q on a CPU, at most
    `cpu_matmul.MAX_ROWS` rows, output columns in whole tiles."""
    out = q.size // max(1, q.shape[0])
    return (jax.default_backend() == "cpu" and x.dtype == jnp.float32 and q.dtype == jnp.int8
            and x.ndim == 2 and 1 <= x.shape[0] <= MAX_ROWS and out % TILE == 0 and cpu_kernels.available())


def cpu_matmul_int8(x: jax.Array, q: jax.Array, scale: jax.Array, max_threads: int = 0) -> jax.Array:
    """(x [T, in] @ q [in, ...]) * scale [...] -> [T, ...] float32, q read as the [in, out] int8 matrix it is, on at
    most `max_threads` of XLA's intra-op threads (0: all)."""
    if not cpu_kernels.available():
        raise RuntimeError("jaxserve's CPU kernels are not available on this machine (see the warning above)")
    q2 = q.reshape(q.shape[0], -1)
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], q2.shape[1]), jnp.float32))(
        x, q2, scale.reshape(-1), max_threads=np.int32(max_threads))
    return y.reshape(x.shape[0], *q.shape[1:])
