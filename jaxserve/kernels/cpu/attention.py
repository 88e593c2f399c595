"""The CPU paged-attention kernel (`attention.cc`), called through jax.ffi.

XLA's CPU code for a few query rows against a long paged history, or a chunk against its own causal triangle,
runs at several times its floors and on one core; the kernel reads each key once for all of a KV head's query
rows (in tiles of 96 rows for long chunks) and spreads (sequence, KV head, tile) items over XLA's intra-op
threads. It is built with the other CPU kernels (`cpu_kernels`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.cpu import library as cpu_kernels
from jaxserve.model.attention import kv_quant
from jaxserve.model.attention.metadata import AttentionMetadata

TARGET = "jaxserve_paged_attention"
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the sizes `AttendAny` in attention.cc is built for
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # the page formats the kernel reads (`--kv-cache-dtype`)
QUANTIZED_TARGET = "jaxserve_quantized_paged_attention"  # codes converted in registers, scales per token


def supports(dtype: jnp.dtype, head_dim: int) -> bool:
    """Whether the kernel can run a model's attention: float32, a head dimension it is built for, the kernels
    built (on a CPU: the caller, `select_backend`, knows the platform)."""
    return jnp.dtype(dtype) == jnp.float32 and head_dim in HEAD_DIMS and cpu_kernels.available()


def cpu_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
                        scale: float) -> jax.Array:
    """Causal attention of every sequence of the ragged batch (q [T, H, D], float32) over float32 pools or
    quantized ones (`kv_quant.QuantizedPool`, int8/fp8 codes); zeros for padded rows, spread over XLA's intra-op
    threads."""
    if not cpu_kernels.available():
        raise RuntimeError("jaxserve's CPU kernels are not available on this machine (see the warning above)")
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    tail = (meta.page_table, meta.kv_lens, meta.cu_q_lens, meta.num_seqs)
    if isinstance(k_cache, kv_quant.QuantizedPool):
        return jax.ffi.ffi_call(QUANTIZED_TARGET, out)(q, k_cache.codes, v_cache.codes, k_cache.scales,
                                                       v_cache.scales, *tail, scale=np.float32(scale))
    return jax.ffi.ffi_call(TARGET, out)(q, k_cache, v_cache, *tail, scale=np.float32(scale))
