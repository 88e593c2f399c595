"""DeepSeek-V2 multi-head latent attention (MLA) over a paged pool of latents.

Each token's KV is cached once for all heads: the normed latent c [kv_lora_rank] and the shared rope key k_pe
[qk_rope_head_dim], side by side in one pool per layer `[num_pages, page_size, 1, kv_lora_rank + rope]`, which
is the planner's `kv_bytes_per_token` for MLA. Attention runs in the latent space ("absorbed" form): the
no-rope query of head h is mapped through that head's key up-projection, q_lat = q_nope @ W_UK[h]^T, so that
q_lat . c + q_pe . k_pe equals HF's q . k with k = [c @ W_UK[h], k_pe]; the output latent p @ c goes through
W_UV[h] afterwards. As attention that is MQA with one KV head of width kv_lora_rank + rope whose values are the
keys' first kv_lora_rank entries, so any backend of the engine runs it (`attention/latent.py`).

Layouts (`x @ W`): q [hidden, H * qk_head] or q_a [hidden, q_lora_rank] + q_a_norm + q_b [q_lora_rank, H *
qk_head] (each head's query: nope, then rope part); kv_a [hidden, kv_lora_rank + rope]; kv_a_norm; kv_b
[kv_lora_rank, H * (nope + v)] (each head: its key part, then its value part); o [H * v, hidden].
The rope parts rotate interleaved pairs (2i, 2i + 1), as DeepSeek's checkpoints (and HF's V2 code) do.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxserve.kernels.cpu.kernel_plan import KernelPlan
from jaxserve.model.attention import kv_quant
from jaxserve.model.attention.backend import AttentionBackend
from jaxserve.model.attention.latent import LatentAttentionBackend
from jaxserve.model.attention.metadata import AttentionMetadata
from jaxserve.model.layers import RMSNorm, linear, normals
from modelspec.spec import ModelSpec

# HF's DeepSeek-V2 builds q_a_layernorm and kv_a_layernorm without passing rms_norm_eps: its default holds.
LATENT_NORM_EPS = 1e-6


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [T, heads, d] as complex pairs (x[2i], x[2i+1]) by the angles of cos/sin [T, d // 2]."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape).astype(x.dtype)


def softmax_scale(spec: ModelSpec) -> float:
    """HF's scale: qk_head_dim^-0.5, times mscale^2 under YaRN rope scaling with mscale_all_dim."""
    scale = spec.q_head_dim**-0.5
    rs = spec.rope_scaling or {}
    if rs.get("rope_type", rs.get("type", "default")) != "default" and rs.get("mscale_all_dim"):
        factor = float(rs["factor"])
        m = 0.1 * float(rs["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return scale


def write_latent(cache: jax.Array, entry: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter this step's latents [T, 1, width] into their slots (page * page_size + offset); a quantized pool
    (`kv_quant.QuantizedPool`) gets codes and one scale a latent row."""
    if isinstance(cache, kv_quant.QuantizedPool):
        return kv_quant.write(cache, entry, slot_mapping)
    num_pages, page_size, one, width = cache.shape
    if entry.shape[0] == 1:
        at = (slot_mapping[0] // page_size, slot_mapping[0] % page_size, 0, 0)
        return lax.dynamic_update_slice(cache, entry.astype(cache.dtype)[None], at)
    flat = cache.reshape(num_pages * page_size, one, width)
    return flat.at[slot_mapping].set(entry.astype(cache.dtype), mode="drop").reshape(cache.shape)


class LatentAttention(nnx.Module):
    """MLA with absorbed up-projections and a latent KV pool (module doc)."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, hidden = spec.num_heads, spec.hidden_size
        self.num_heads = h
        self.rank, self.rope, self.nope, self.v = (spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim,
                                                   spec.v_head_dim)
        qk = self.nope + self.rope
        shapes = [((hidden, self.rank + self.rope), hidden**-0.5),
                  ((self.rank, h * (self.nope + self.v)), self.rank**-0.5),
                  ((h * self.v, hidden), (h * self.v) ** -0.5)]
        if spec.q_lora_rank:
            shapes += [((hidden, spec.q_lora_rank), hidden**-0.5), ((spec.q_lora_rank, h * qk), spec.q_lora_rank**-0.5)]
        else:
            shapes += [((hidden, h * qk), hidden**-0.5)]
        kv_a, kv_b, o, *q = normals(rngs.params(), tuple(shapes), dtype)
        self.kv_a, self.kv_b, self.o = nnx.Param(kv_a), nnx.Param(kv_b), nnx.Param(o)
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS, dtype)
        if spec.q_lora_rank:
            self.q_a, self.q_b, self.q = nnx.Param(q[0]), nnx.Param(q[1]), None
            self.q_a_norm = RMSNorm(spec.q_lora_rank, LATENT_NORM_EPS, dtype)
        else:
            self.q_a = self.q_b = self.q_a_norm = None
            self.q = nnx.Param(q[0])
        self.scale = softmax_scale(spec)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, kv: tuple[jax.Array], meta: AttentionMetadata,
                 cpu_kernel: bool, attention: AttentionBackend,
                 plan: KernelPlan | None = None) -> tuple[jax.Array, tuple[jax.Array]]:
        t, h = x.shape[0], self.num_heads
        if self.q is not None:
            q = linear(x, self.q[...], cpu_kernel, plan)
        else:
            q = linear(self.q_a_norm(linear(x, self.q_a[...], cpu_kernel, plan)), self.q_b[...], cpu_kernel, plan)
        q = q.reshape(t, h, self.nope + self.rope)
        ckv = linear(x, self.kv_a[...], cpu_kernel, plan)
        c, k_pe = self.kv_a_norm(ckv[:, : self.rank]), ckv[:, None, self.rank:]
        q_pe, k_pe = apply_rope_interleaved(q[..., self.nope:], cos, sin), apply_rope_interleaved(k_pe, cos, sin)
        kv_b = self.kv_b[...].reshape(self.rank, h, self.nope + self.v)
        q_lat = jnp.einsum("thn,rhn->thr", q[..., : self.nope], kv_b[..., : self.nope])
        cache = write_latent(kv[0], jnp.concatenate([c[:, None], k_pe], axis=-1), meta.slot_mapping)
        o_lat = LatentAttentionBackend(attention, self.rank)(jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], -1),
                                                             cache, meta, self.scale)
        o = jnp.einsum("thr,rhv->thv", o_lat, kv_b[..., self.nope:]).reshape(t, h * self.v)
        return linear(o, self.o[...], cpu_kernel, plan), (cache,)
