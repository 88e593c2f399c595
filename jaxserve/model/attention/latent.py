"""Attention over a latent KV pool (DeepSeek's MLA) through any engine backend.

MLA caches one row per token, [latent c | rope key k_pe], in a pool `[num_pages, page_size, 1, rank + rope]`.
In latent space its attention is MQA with that row as the key and its first `rank` entries as the value, so this
adapter hands the same pool to the engine's backend as both K and V and keeps the first `rank` output columns.
The backend was chosen at start-up for this pool's width like any other (`select.select_backend`: the C++ kernel
or Pallas where they take that head dimension, else the jnp reference), so nothing here looks at the platform.
The price: the backend reads each row twice (as key and as value), and computes rope/(rank + rope) more output
than it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.model.attention.backend import AttentionBackend


@dataclass(frozen=True)
class LatentAttentionBackend:
    """`inner` over a latent pool: q [T, H, rank + rope] -> [T, H, rank]."""

    inner: AttentionBackend
    rank: int

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def q_blocks(self) -> tuple[int, ...]:
        return self.inner.q_blocks

    def __call__(self, q: jax.Array, pool: jax.Array, meta: AttentionMetadata, scale: float) -> jax.Array:
        return self.inner(q, pool, pool, meta, scale)[..., : self.rank]
