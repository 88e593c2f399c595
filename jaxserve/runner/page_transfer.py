"""KV pages moved between pools: gathered from one runner's pool as a block, written into another's (donated).

A block is `[layers, 2, pages, page_size, heads, head_dim]`, padded to a page-count bucket (pads read the trash page
0 and are written nowhere). Gathering can keep every `stride`-th KV head only (the model's own heads, leaving out
replicas made for tensor parallelism); inserting replicates heads up to the receiving pool's count.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.runner.buckets import bucket_for
from jaxserve.runner.compiles import compiled_variants
from jaxserve.runner.parallel import AXIS, fit_spec


def _gather_impl(kv_caches, page_ids, stride: int):
    """Pages of every layer's K and V; every `stride`-th KV head (drops replicas made for TP)."""
    return jnp.stack([jnp.stack([k[page_ids][..., ::stride, :], v[page_ids][..., ::stride, :]])
                      for k, v in kv_caches])


def _insert_impl(kv_caches, pages, page_ids):
    """Write a block into `page_ids` (out-of-range ids are dropped), replicating heads up to the pool's."""
    r = kv_caches[0][0].shape[2] // pages.shape[4]
    if r > 1:
        pages = jnp.repeat(pages, r, axis=4)
    return [(k.at[page_ids].set(pages[i, 0], mode="drop"), v.at[page_ids].set(pages[i, 1], mode="drop"))
            for i, (k, v) in enumerate(kv_caches)]


class PageMover:
    """Gathers and inserts page blocks on one `ModelRunner`'s pool, compiled per page-count bucket."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._gather = jax.jit(_gather_impl, static_argnums=(2,))
        kv_sh = jax.tree.map(lambda x: x.sharding, runner.kv_caches)
        self._insert = jax.jit(_insert_impl, donate_argnums=(0,),
                               **({} if runner.mesh is None else dict(out_shardings=kv_sh)))

    def sharding(self, shape: tuple[int, ...]) -> jax.sharding.Sharding:
        """Sharding of a block here: on heads if they divide the mesh, else replicated."""
        r = self.runner
        if r.mesh is None:
            return r.kv_caches[0][0].sharding
        return NamedSharding(r.mesh, fit_spec(P(None, None, None, None, AXIS, None), shape, r.mesh))

    def _index(self, page_ids: list[int], fill: int, size: int | None = None) -> np.ndarray:
        index = np.full(size or bucket_for(len(page_ids), self.runner.page_buckets), fill, np.int32)
        index[: len(page_ids)] = page_ids
        return index

    def gather(self, page_ids: list[int], unique_heads: int | None = None) -> jax.Array:
        """KV of `page_ids` as one block (pads: page 0); with `unique_heads` (the model's own KV head count),
        heads replicated for TP are left out."""
        r = self.runner
        pool_heads = r.kv_caches[0][0].shape[2]
        stride = pool_heads // (unique_heads or pool_heads)
        return self._gather(r.kv_caches, r.put(self._index(page_ids, 0)), stride)

    def insert(self, pages: jax.Array, page_ids: list[int]) -> None:
        """Write a block from `gather` (already on this pool's devices) into `page_ids` (the pool donated)."""
        r = self.runner
        num_pages = r.kv_caches[0][0].shape[0]
        r.kv_caches = self._insert(r.kv_caches, pages, r.put(self._index(page_ids, num_pages, pages.shape[2])))

    def put(self, pages: jax.Array) -> jax.Array:
        """Move a gathered block onto this pool's devices, sharded on heads (the device-to-device copy)."""
        return jax.device_put(pages, self.sharding(pages.shape))

    def warmup(self, unique_heads: int | None = None, *, gather: bool = True, insert: bool = True) -> None:
        """Compile `gather` and/or `insert` for every page-count bucket."""
        r = self.runner
        k = r.kv_caches[0][0]
        for n in r.page_buckets:
            if gather:
                jax.block_until_ready(self.gather([0] * n, unique_heads))
            if insert:
                shape = (len(r.kv_caches), 2, n, k.shape[1], unique_heads or k.shape[2], k.shape[3])
                self.insert(jnp.zeros(shape, k.dtype, device=self.sharding(shape)), [])
        jax.block_until_ready(r.kv_caches)

    def compile_count(self) -> int:
        return compiled_variants((self._gather, self._insert))
