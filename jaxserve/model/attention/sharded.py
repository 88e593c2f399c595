"""An attention kernel under tensor parallelism: `shard_map` over the mesh's tensor-parallel axis, each device
attending with its own query heads over its own KV heads.

A kernel (Pallas) is one custom call that XLA cannot split across devices, so the step's q [T, H, D] (sharded on H
by the column-parallel qkv projection) and the KV pools [pages, page_size, KVH, D] (sharded on KVH) are handed to
it per device: device i holds heads H/tp and KV heads KVH/tp of the same groups (the qkv layout groups each KV
head's query heads; `runner/parallel.py` replicates KV heads when tp exceeds them), so the kernel's GQA contract
holds on every shard and the outputs, sharded on H, need no communication. The metadata is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.kernels.metadata import AttentionMetadata


def _shard_map(fn: Any, mesh: Mesh, in_specs: Any, out_specs: Any) -> Any:
    """`jax.shard_map` where this jax has it, else `jax.experimental.shard_map.shard_map` (no replication check:
    the kernel's custom call has no rule for it)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map

    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def _pool_spec(pool: Any, axis: str) -> Any:
    """The pool's leaves sharded on their KV-head axis (codes [N, P, KVH, D], scales [N, P, KVH])."""
    return jax.tree.map(lambda x: P(None, None, axis, *(None,) * (x.ndim - 3)), pool)


@dataclass(frozen=True)
class ShardedAttention:
    """`inner` (a kernel backend) run per device of `mesh` on its share of the heads (see the module doc)."""

    inner: Any
    mesh: Mesh
    axis: str = "tp"

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def q_blocks(self) -> tuple[int, ...]:
        return self.inner.q_blocks

    def __call__(self, q: jax.Array, k_cache: Any, v_cache: Any, meta: AttentionMetadata, scale: float) -> jax.Array:
        heads = P(None, self.axis, None)
        attend = _shard_map(lambda q, k, v, m: self.inner(q, k, v, m, scale), self.mesh,
                            in_specs=(heads, _pool_spec(k_cache, self.axis), _pool_spec(v_cache, self.axis),
                                      jax.tree.map(lambda _: P(), meta)),
                            out_specs=heads)
        return attend(q, k_cache, v_cache, meta)
