"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE, DeepSeek-V2): a router, top-k of E experts, optional shared experts.

Compute reads only the experts a step uses. The step's (token, expert) assignments are sorted by expert and laid
out in tiles of R rows, each tile holding rows of one expert only (an expert's rows padded to whole tiles); a loop
runs over the tiles in use, each reading its expert's weights with a dynamic slice and doing two small GEMMs. So a
decode step of T <= 64 tokens (R = T: one tile per expert touched) reads each distinct expert once, and its weight
traffic follows the number of distinct experts the batch activates, not E. The loop's trip count is a device
value: on a CPU that is free; on a GPU each iteration of an XLA while loop waits on the host (docs/models.md).
On a CPU with jaxserve's kernels, the step sizes the kernel plan names run all tiles in one grouped-matmul call
instead (`cpu_matmul.cpu_grouped_matmul`): it reads each expert in place, where XLA's loop copies every tile's
expert out of the stacked weights before its dot.

Layout: router [hidden, E] (float32 logits, as DeepSeek's HF code keeps it), experts_gate_up [E, hidden, 2, I]
(gate, then up), experts_down [E, I, hidden]; shared experts are one `MLP` of width I * num_shared_experts.
Tensor parallelism splits every expert's I axis (`weights.PARTITION_SPECS`): each device runs all tiles on its
slice and XLA all-reduces the down projection's partial sums, so the routing and the tiles are the same on
every device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxserve.kernels.cpu import matmul as cpu_matmul
from jaxserve.kernels.cpu.kernel_plan import KernelPlan
from jaxserve.model.layers import linear, normals
from modelspec.moe_tiles import DECODE_TILE_MAX, tile_rows  # one layout, priced by the planner
from modelspec.spec import ModelSpec


def route(logits: jax.Array, k: int, *, norm_topk_prob: bool, scaling: float = 1.0, topk_method: str = "greedy",
          n_group: int = 1, topk_group: int = 1) -> tuple[jax.Array, jax.Array]:
    """Routing weights [T, k] (float32) and expert ids [T, k] from router logits [T, E], as HF does it.

    Softmax over all experts in float32, the top k (DeepSeek-V2's `group_limited_greedy`: only within the
    `topk_group` groups of highest max score), renormalized to sum 1 if `norm_topk_prob`, times `scaling`.
    """
    scores = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if topk_method == "group_limited_greedy":
        t, e = scores.shape
        groups = scores.reshape(t, n_group, e // n_group)
        _, keep = lax.top_k(jnp.max(groups, axis=-1), topk_group)
        mask = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], keep].set(True)
        scores = jnp.where(jnp.repeat(mask, e // n_group, axis=1), scores, 0.0)
    elif topk_method != "greedy":
        raise ValueError(f"topk_method {topk_method!r} is not supported (greedy, group_limited_greedy)")
    weights, ids = lax.top_k(scores, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * scaling, ids


def grouped_experts(x: jax.Array, ids: jax.Array, weights: jax.Array, gate_up: jax.Array, down: jax.Array,
                    linear=None, grouped=None, num_tokens: jax.Array | None = None) -> jax.Array:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for x [T, hidden], each expert a SwiGLU MLP.

    gate_up [E, hidden, 2, I], down [E, I, hidden]. Only the tiles of experts some token chose run (module doc):
    in a loop of `linear(x, w)` (default: XLA's dot), or all at once by `grouped(tiles_x, w, tile_expert,
    tile_rows)` (`cpu_matmul.cpu_grouped_matmul`'s contract) where one is given. `num_tokens`: the step's real
    tokens (a device scalar); the rows after them (the bucket's padding) go to no expert and come out zero.
    """
    linear = linear or (lambda a, w: a @ w.reshape(w.shape[0], -1))
    t, k = ids.shape
    e, hidden = gate_up.shape[0], x.shape[1]
    r = tile_rows(t, k, e)
    a = t * k
    max_tiles = min(a, (a + min(e, a) * (r - 1)) // r)
    if num_tokens is not None:  # padding rows are one token repeated: routed, they pile onto two experts' tiles
        ids = jnp.where((jnp.arange(t) < num_tokens)[:, None], ids, e)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert (expert e, padding, last)
    sorted_e = flat[order]
    counts = jnp.zeros(e, jnp.int32).at[flat].add(1, mode="drop")
    tiles = (counts + r - 1) // r
    tile_end = jnp.cumsum(tiles)
    group_start = jnp.cumsum(counts) - counts
    padded_start = (tile_end - tiles) * r
    # Padding's rows land past the tiles (dropped below) and read no output.
    padded_start, group_start = (jnp.append(padded_start, max_tiles * r), jnp.append(group_start, 0))
    dest = padded_start[sorted_e] + jnp.arange(a, dtype=jnp.int32) - group_start[sorted_e]  # row in the tiles
    token_of_row = jnp.full(max_tiles * r, t, jnp.int32).at[dest].set(order // k, mode="drop")  # t: a zero row
    xs = jnp.concatenate([x, jnp.zeros((1, hidden), x.dtype)])[token_of_row]
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(max_tiles, dtype=jnp.int32), side="right")

    def tile(j: jax.Array, out: jax.Array) -> jax.Array:
        ex = tile_expert[j]
        rows = lax.dynamic_slice_in_dim(xs, j * r, r)
        gu = linear(rows, lax.dynamic_index_in_dim(gate_up, ex, keepdims=False)).reshape(r, 2, -1)
        y = linear(jax.nn.silu(gu[:, 0]) * gu[:, 1], lax.dynamic_index_in_dim(down, ex, keepdims=False))
        return lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), j * r, 0)

    if grouped is not None:
        j = jnp.arange(max_tiles, dtype=jnp.int32)
        ex = jnp.minimum(tile_expert, e - 1)  # tiles past the last in use: no rows (below), any expert
        first = tile_end - tiles
        used = jnp.where(j < tile_end[-1], jnp.clip(counts[ex] - (j - first[ex]) * r, 0, r), 0)
        gu = grouped(xs, gate_up, ex, used)
        out = grouped(jax.nn.silu(gu[:, 0]) * gu[:, 1], down, ex, used)
    else:
        out = lax.fori_loop(0, tile_end[-1], tile, jnp.zeros((max_tiles * r, hidden), x.dtype))
    w_sorted = weights.reshape(-1)[order].astype(jnp.float32)
    rows = jnp.where((sorted_e < e)[:, None], out[jnp.minimum(dest, max_tiles * r - 1)].astype(jnp.float32), 0.0)
    contrib = (rows * w_sorted[:, None]).astype(x.dtype)
    return jnp.zeros_like(x).at[order // k].add(contrib)


class MoE(nnx.Module):
    """Routed experts (+ shared experts) replacing a decoder layer's MLP."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype, rngs: nnx.Rngs, shared: nnx.Module | None = None):
        e, hidden, inter = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
        router, gate_up, down = normals(rngs.params(), (((hidden, e), hidden**-0.5),
                                                         ((e, hidden, 2, inter), hidden**-0.5),
                                                         ((e, inter, hidden), inter**-0.5)), dtype)
        self.router = nnx.Param(router.astype(jnp.float32))
        self.experts_gate_up = nnx.Param(gate_up)
        self.experts_down = nnx.Param(down)
        self.shared = shared
        self.top_k = spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.scaling = spec.routed_scaling_factor
        self.topk_method, self.n_group, self.topk_group = spec.topk_method, spec.n_group, spec.topk_group

    def __call__(self, x: jax.Array, cpu_kernel: bool = False, plan: KernelPlan | None = None,
                 num_tokens: jax.Array | None = None) -> jax.Array:
        """The routed (+ shared) experts of x [T, hidden]; rows from `num_tokens` on (padding) skip the routed ones."""
        logits = x.astype(jnp.float32) @ self.router[...]
        weights, ids = route(logits, self.top_k, norm_topk_prob=self.norm_topk_prob, scaling=self.scaling,
                             topk_method=self.topk_method, n_group=self.n_group, topk_group=self.topk_group)
        gate_up, down = self.experts_gate_up[...], self.experts_down[...]
        # XLA's dots in the loop, not the C++ kernel: on an expert sliced inside the loop it ran slower; the grouped
        # kernel reads the experts in place instead, at the step sizes the plan measured it faster (docs/models.md).
        mm = lambda a, w: linear(a, w.reshape(w.shape[0], -1))  # noqa: E731
        use = (cpu_kernel and (plan is None or plan.moe(x.shape[0])) and x.shape[0] <= DECODE_TILE_MAX
               and cpu_matmul.supports_grouped(x, gate_up) and cpu_matmul.supports_grouped(x, down))
        y = grouped_experts(x, ids, weights, gate_up, down, mm, cpu_matmul.cpu_grouped_matmul if use else None,
                            num_tokens)
        if self.shared is not None:
            y = y + self.shared(x, cpu_kernel, plan)
        return y
