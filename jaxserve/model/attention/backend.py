"""The attention backend contract: one object, chosen once at start-up (`select.select_backend`), attends for every
layer of every step.

A backend is called as `backend(q, k_cache, v_cache, meta, scale)` inside the jitted step, after the layer's
`write_kv` scatter has put this step's keys and values into their slots:

- q [T, H, D]: the step's queries; T padded tokens, decodes first (one token each), then prefill chunks, then
  padding;
- k_cache, v_cache [num_pages, page_size, kv_heads, D]: one layer's pool, page 0 the trash page; with
  `--kv-cache-dtype int8|fp8` each a `kv_quant.QuantizedPool` (codes and per-row scales), which every backend reads;
- meta (`AttentionMetadata`): cu_q_lens [S+1], kv_lens [S] (context including this step's tokens), the page
  table [S, P], num_seqs, num_decodes; padded sequences have q_len 0 and kv_len 0.

It returns [T, H, D] in q's dtype: each sequence's queries attend causally over its first kv_len cached tokens
(query i of a chunk sits at position kv_len - q_len + i); padded rows are zeros. H is a multiple of kv_heads
(GQA/MQA) and no backend repeats KV. Backends are frozen dataclasses: hashable, so a jitted function carries one
as static configuration, and whatever a backend decides about the platform it decided when it was built.
"""

from __future__ import annotations

from typing import Protocol

import jax

from jaxserve.kernels.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """What the model calls for paged attention (see the module docstring for the contract)."""

    name: str  # "reference", "cpu" or "pallas": what the engine config, the log and /version report

    @property
    def q_blocks(self) -> tuple[int, ...]:
        """Query-token block sizes prefill chunks are cut into, largest first (the smallest is the finest chunk
        worth scheduling: a finer one pays for that block's rows anyway)."""
        ...

    def __call__(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
                 scale: float) -> jax.Array: ...


def smallest_chunk(backend: AttentionBackend, page_size: int) -> int:
    """The finest prefill chunk worth scheduling with `backend`: its smallest query block, at most a page."""
    return min(page_size, *backend.q_blocks)
