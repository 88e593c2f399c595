"""The CPU backend: the whole step's attention in jaxserve's C++ kernel (`cpu_attention`, through jax.ffi).

Chosen only where it can run (a CPU, float32, a head dimension the kernel is built for, the kernels built, one
device): `select.select_backend` decides that once, so a call never falls back.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from jaxserve.kernels.cpu import attention as cpu_attention
from jaxserve.model.attention.metadata import AttentionMetadata
from jaxserve.model.attention.paged_attention import DEFAULT_Q_BLOCKS


@dataclass(frozen=True)
class CpuKernelAttention:
    """`cpu_attention.cpu_paged_attention` as a backend."""

    name: str = "cpu"

    @property
    def q_blocks(self) -> tuple[int, ...]:
        # The kernel pads no rows; the CPU's query blocks keep the finest chunk calibrate and reports take as it was.
        return DEFAULT_Q_BLOCKS

    def __call__(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
                 scale: float) -> jax.Array:
        return cpu_attention.cpu_paged_attention(q, k_cache, v_cache, meta, scale)
