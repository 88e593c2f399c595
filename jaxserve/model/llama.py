"""The decoder of every family served (Llama 2/3/3.1, Mistral, Qwen2, Qwen3; Mixtral, Qwen3-MoE; DeepSeek-V2) in
Flax NNX over a paged KV cache. A layer's attention is GQA (`Attention`, Qwen3's q/k norm included) or MLA
(`mla.LatentAttention`); its MLP is SwiGLU (`layers.MLP`) or routed experts (`moe.MoE`), per `ModelSpec`.

Weights live in the layout the matmul reads (`x @ W`, W as [in, out]) and each layer is its own module
(a list, not stacked arrays): XLA on CPU reads both fastest. Fused projections are grouped so tensor
parallelism can later shard them on a leading axis without re-laying them out:

- qkv: [hidden, kv_heads, group + 2, head_dim]; for KV head j, slots 0..group-1 are its query heads
  (HF head j * group + i), slot group is its key, slot group + 1 its value.
- gate_up: [hidden, 2, intermediate] (gate, then up).

The KV pool holds per layer (k, v) `[num_pages, page_size, kv_heads, head_dim]` for GQA, or one latent pool
`(latent,)` `[num_pages, page_size, 1, kv_lora_rank + qk_rope_head_dim]` for MLA (`kv_pool_layout`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.kernels.cpu import matmul as cpu_matmul
from jaxserve.kernels.cpu import matmul_int8 as cpu_matmul_int8
from jaxserve.kernels.cpu.kernel_plan import KernelPlan
from jaxserve.model.attention.backend import AttentionBackend
from jaxserve.model.attention.kv_quant import kv_kind
from jaxserve.model.attention.metadata import AttentionMetadata
from jaxserve.model.attention.paged_attention import write_kv
from jaxserve.model.attention.select import auto_backend
from jaxserve.model.dtypes import planner_dtype, resolve_dtype
from jaxserve.model.layers import CPU_EIGEN_MAX_ROWS, MLP, RMSNorm, linear, normals
from jaxserve.model.mla import LatentAttention
from jaxserve.model.moe import MoE
from jaxserve.model.quantize import QuantizedWeight
from jaxserve.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from modelspec.memory import kv_bytes_per_token
from modelspec.spec import ModelSpec

# Per layer (k, v), each [num_pages, page_size, kv_heads, head_dim]; MLA: (latent,) (module doc).
KVCaches = list[tuple[jax.Array, ...]]
__all__ = ["CPU_EIGEN_MAX_ROWS", "KVCaches", "LlamaForCausalLM", "RMSNorm", "init_kv_cache", "linear"]

class Attention(nnx.Module):
    """GQA self-attention with a fused, KV-head-grouped qkv projection and paged KV."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.group = h // kvh
        hidden = spec.hidden_size
        shapes = (((hidden, kvh, self.group + 2, d), hidden**-0.5), ((h * d, hidden), (h * d) ** -0.5))
        if spec.qkv_bias:
            shapes += (((kvh, self.group + 2, d), 0.02),)
        qkv, o, *bias = normals(rngs.params(), shapes, dtype)
        self.qkv = nnx.Param(qkv)
        self.qkv_bias = nnx.Param(bias[0]) if bias else None
        self.o = nnx.Param(o)
        # Qwen3: one RMSNorm over head_dim shared by all query heads, one by all key heads.
        self.q_norm = RMSNorm(d, spec.rms_norm_eps, dtype) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.rms_norm_eps, dtype) if spec.qk_norm else None
        self.scale = d**-0.5

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, kv: tuple[jax.Array, jax.Array],
                 meta: AttentionMetadata, cpu_kernel: bool, attention: AttentionBackend,
                 plan: KernelPlan | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        t = x.shape[0]
        w = self.qkv[...]
        qkv = linear(x, w.reshape(w.shape[0], -1), cpu_kernel, plan)
        qkv = qkv.reshape(t, self.num_kv_heads, self.group + 2, self.head_dim)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias[...]
        q = qkv[:, :, : self.group].reshape(t, self.num_heads, self.head_dim)
        k, v = qkv[:, :, self.group], qkv[:, :, self.group + 1]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
        o = attention(q, k_cache, v_cache, meta, self.scale)
        return linear(o.reshape(t, -1), self.o[...], cpu_kernel, plan), (k_cache, v_cache)


class DecoderLayer(nnx.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype, rngs: nnx.Rngs, index: int = 0):
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.attn = LatentAttention(spec, dtype, rngs) if spec.is_mla else Attention(spec, dtype, rngs)
        self.post_attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        if spec.is_moe_layer(index):
            shared = (MLP(spec, dtype, rngs, spec.moe_intermediate_size * spec.num_shared_experts)
                      if spec.num_shared_experts else None)
            self.mlp = MoE(spec, dtype, rngs, shared)
        else:
            self.mlp = MLP(spec, dtype, rngs)

    def matmul_weights(self) -> list[jax.Array]:
        """The [in, ...] weights this layer's projections pass to `linear` with the kernel allowed (not the expert
        tiles, which stay in XLA), for `kernel_choice` to time the kernel on."""
        attn, mlp = self.attn, self.mlp
        if isinstance(attn, LatentAttention):
            ws = [p[...] for p in (attn.q, attn.q_a, attn.q_b, attn.kv_a, attn.o) if p is not None]
        else:
            qkv = attn.qkv[...]
            ws = [qkv.reshape(qkv.shape[0], -1), attn.o[...]]
        if isinstance(mlp, MoE):
            mlp = mlp.shared
        return ws + ([mlp.gate_up[...], mlp.down[...]] if mlp is not None else [])

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, kv: tuple[jax.Array, ...],
                 meta: AttentionMetadata, cpu_kernel: bool, attention: AttentionBackend,
                 plan: KernelPlan | None = None) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        a, kv = self.attn(self.input_norm(x), cos, sin, kv, meta, cpu_kernel, attention, plan)
        x = x + a
        h = self.post_attn_norm(x)
        if isinstance(self.mlp, MoE):  # the bucket's padding rows (after the real tokens) run no routed expert
            return x + self.mlp(h, cpu_kernel, plan, num_tokens=meta.num_tokens), kv
        return x + self.mlp(h, cpu_kernel, plan), kv


class LlamaForCausalLM(nnx.Module):
    """The decoder stack, final norm and (tied or untied) LM head."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype | str = jnp.float32, *, rngs: nnx.Rngs):
        if spec.architecture == "deepseek_v3":
            raise ValueError(f"{spec.name}: DeepSeek-V3's routing (sigmoid scores, grouped top-k with a bias) is "
                             "not implemented; DeepSeek-V2 is")
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(f"{spec.name}: num_heads {spec.num_heads} not a multiple of {spec.num_kv_heads}")
        dtype = resolve_dtype(dtype)
        self.num_layers = spec.num_layers
        self.dtype = dtype
        # Embedding rows of norm ~1 keep the residual stream sane; tied heads then give logits of std ~1.
        std = spec.hidden_size**-0.5 if spec.tie_word_embeddings else 1.0
        shapes = [((spec.vocab_size, spec.hidden_size), std)]
        if not spec.tie_word_embeddings:
            shapes.append(((spec.hidden_size, spec.vocab_size), spec.hidden_size**-0.5))
        embed, *head = normals(rngs.params(), tuple(shapes), dtype)
        self.embed = nnx.Param(embed)
        self.layers = nnx.List([DecoderLayer(spec, dtype, rngs, i) for i in range(spec.num_layers)])
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.lm_head = nnx.Param(head[0]) if head else None
        # Static (hashable) so the graph definition carries it, not the parameter state.
        inv_freq = rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        self.inv_freq = tuple(float(f) for f in inv_freq)

    def __call__(self, token_ids: jax.Array, positions: jax.Array, kv_caches: KVCaches,
                 meta: AttentionMetadata, *, cpu_kernel: bool = True,
                 attention: AttentionBackend | None = None,
                 plan: KernelPlan | None = None) -> tuple[jax.Array, KVCaches]:
        """Run T tokens; returns the final-normed hidden states [T, hidden] and the updated caches.

        `attention`: the backend every layer attends with, chosen at start-up (the runner's); None: what `auto`
        picks on the default platform. `cpu_kernel=False` keeps the matmuls (and, when `attention` is None,
        attention) in XLA even where jaxserve's CPU kernels could run (a mesh of several devices: XLA cannot
        split a custom call over them); `plan` names the row counts whose matmuls may use the kernel (None: all).
        """
        if attention is None:
            k0 = kv_caches[0][0]
            attention = auto_backend(k0.dtype, k0.shape[3], k0.shape[1], cpu_kernel, kv_kind(k0))
        x = jnp.take(self.embed[...], token_ids, axis=0)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, kv = layer(x, cos, sin, kv, meta, cpu_kernel, attention, plan)
            new_caches.append(kv)
        return self.norm(x), new_caches

    def compute_logits(self, hidden: jax.Array, cpu_kernel: bool = False, plan: KernelPlan | None = None) -> jax.Array:
        """Float32 logits [N, vocab] of hidden rows [N, hidden]; `cpu_kernel` as in `__call__`, `plan` for the head's
        row counts (a tied head reads the embedding in place through the kernel's x @ w^T; see docs/tuning.md)."""
        cpu_kernel = cpu_kernel and (plan is None or plan.head(hidden.shape[0]))
        if self.lm_head is not None:
            head = self.lm_head[...]
            if cpu_kernel and isinstance(head, QuantizedWeight) and cpu_matmul_int8.supports(hidden, head.q):
                threads = plan.int8_threads(hidden.shape[0]) if plan else 0
                return cpu_matmul_int8.cpu_matmul_int8(hidden, head.q, head.scale, threads)
            return linear(hidden, head, cpu_kernel).astype(jnp.float32)
        embed = self.embed[...]
        if cpu_kernel and cpu_matmul.supports_nt(hidden, embed):
            return cpu_matmul.cpu_matmul_nt(hidden, embed)
        return (hidden @ embed.T).astype(jnp.float32)


def kv_pool_layout(spec: ModelSpec, num_pages: int, page_size: int) -> tuple[tuple[int, ...], int]:
    """The shape of one layer's pool array and how many a layer has: (k, v) for GQA, one latent pool for MLA."""
    if spec.is_mla:
        return (num_pages, page_size, 1, spec.kv_lora_rank + spec.qk_rope_head_dim), 1
    return (num_pages, page_size, spec.num_kv_heads, spec.head_dim), 2


def init_kv_cache(spec: ModelSpec, num_pages: int, page_size: int,
                  dtype: jnp.dtype | str = jnp.float32) -> KVCaches:
    """Zeroed per-layer page pools (`kv_pool_layout`; page 0: trash)."""
    dtype = resolve_dtype(dtype)
    shape, n = kv_pool_layout(spec, num_pages, page_size)
    return [tuple(jnp.zeros(shape, dtype) for _ in range(n)) for _ in range(spec.num_layers)]


def kv_cache_bytes(spec: ModelSpec, num_pages: int, page_size: int,
                   dtype: jnp.dtype | str = jnp.float32) -> int:
    """Bytes `init_kv_cache` allocates (all layers); equals the planner's formula times tokens."""
    shape, n = kv_pool_layout(spec, num_pages, page_size)
    size = 1
    for d in shape:
        size *= d
    return spec.num_layers * n * size * resolve_dtype(dtype).itemsize


def planner_kv_bytes(spec: ModelSpec, num_pages: int, page_size: int, dtype: jnp.dtype | str) -> float:
    """The planner's prediction for the same pool (tp=1), for cross-checks."""
    return num_pages * page_size * kv_bytes_per_token(spec, planner_dtype(resolve_dtype(dtype)))
