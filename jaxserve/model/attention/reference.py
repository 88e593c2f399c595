"""The jnp reference backend: `paged_attention.paged_attention` with a platform's tuning fixed at construction.

It runs anywhere XLA does and is what the other backends are tested against. On a CPU without the C++ kernel it
is the fast path (per-sequence decode loops, narrow KV blocks, wide blocks over the history a query block sees
whole); elsewhere it is the fallback: its loops run to device-side lengths, which on a GPU cost a host round trip
per iteration, so an accelerator tuning keeps them few (one batched decode loop, 2048-key blocks, two query-block
sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.model.attention.paged_attention import (
    ACCELERATOR_KV_BLOCK,
    ACCELERATOR_Q_BLOCKS,
    DEFAULT_DECODE_KV_BLOCK,
    DEFAULT_DECODE_TAIL_BLOCK,
    DEFAULT_KV_BLOCK,
    DEFAULT_Q_BLOCKS,
    paged_attention,
)


@dataclass(frozen=True)
class ReferenceAttention:
    """`paged_attention` with these block sizes and decode mode (see its docstring); the defaults are a CPU's."""

    kv_block: int = DEFAULT_KV_BLOCK
    q_block_sizes: tuple[int, ...] = DEFAULT_Q_BLOCKS
    decode_kv_block: int = DEFAULT_DECODE_KV_BLOCK
    decode_tail_block: int = DEFAULT_DECODE_TAIL_BLOCK
    decode_mode: str = "loop"
    wide_blocks: bool = True
    name: str = "reference"

    def __post_init__(self) -> None:
        if self.decode_mode not in ("loop", "batched"):
            raise ValueError(f"decode_mode must be loop or batched, not {self.decode_mode!r}")

    @property
    def q_blocks(self) -> tuple[int, ...]:
        return tuple(sorted(self.q_block_sizes, reverse=True))

    def __call__(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
                 scale: float) -> jax.Array:
        return paged_attention(q, k_cache, v_cache, meta, scale, kv_block=self.kv_block, q_blocks=self.q_blocks,
                               decode_kv_block=self.decode_kv_block, decode_tail_block=self.decode_tail_block,
                               decode_mode=self.decode_mode, wide_blocks=self.wide_blocks)


CPU_TUNING = ReferenceAttention()
# Off a CPU every loop iteration is a host round trip: one batched decode loop, wide KV blocks, two block sizes.
ACCELERATOR_TUNING = ReferenceAttention(kv_block=ACCELERATOR_KV_BLOCK, q_block_sizes=ACCELERATOR_Q_BLOCKS,
                                        decode_mode="batched", wide_blocks=False)

