"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2) in Flax NNX over a paged KV cache.

Weights live in the layout the matmul reads (`x @ W`, W as [in, out]) and each layer is its own module
(a list, not stacked arrays): XLA on CPU reads both fastest. Fused projections are grouped so tensor
parallelism can later shard them on a leading axis without re-laying them out:

- qkv: [hidden, kv_heads, group + 2, head_dim]; for KV head j, slots 0..group-1 are its query heads
  (HF head j * group + i), slot group is its key, slot group + 1 its value.
- gate_up: [hidden, 2, intermediate] (gate, then up).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxserve.model.attention.backend import AttentionBackend
from jaxserve.model.attention.metadata import AttentionMetadata
from jaxserve.model.attention.paged_attention import write_kv
from jaxserve.model.attention.select import auto_backend
from jaxserve.model.dtypes import planner_dtype, resolve_dtype
from jaxserve.model.kernels import cpu_matmul
from jaxserve.model.kernels.kernel_plan import KernelPlan
from jaxserve.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from planner.memory import kv_bytes_per_token
from planner.model_spec import ModelSpec

# Per layer (k, v), each [num_pages, page_size, kv_heads, head_dim].
KVCaches = list[tuple[jax.Array, jax.Array]]

# Token counts up to which a CPU step's projections go to Eigen rather than YNNPACK (`linear`); see docs/tuning.md.
CPU_EIGEN_MAX_ROWS = 16

def _normals(key: jax.Array, shapes_stds: tuple[tuple[tuple[int, ...], float], ...],
             dtype: jnp.dtype) -> list[jax.Array]:
    """Seeded normal arrays for (shape, std) pairs.

    Drawn on the host with numpy, seeded from the key's data: no XLA compile (threefry kernels take seconds
    to compile per shape on CPU) and the same values on every platform. Under a trace (e.g. `nnx.eval_shape`)
    the key is abstract and jax.random stands in.
    """
    if isinstance(key, jax.core.Tracer):
        keys = jax.random.split(key, len(shapes_stds))
        return [(jax.random.normal(k, shape, jnp.float32) * std).astype(dtype)
                for k, (shape, std) in zip(keys, shapes_stds, strict=True)]
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    return [jnp.asarray((rng.standard_normal(shape, dtype=np.float32) * np.float32(std)), dtype=dtype)
            for shape, std in shapes_stds]


def linear(x: jax.Array, w: jax.Array, cpu_kernel: bool = False, plan: KernelPlan | None = None) -> jax.Array:
    """x [T, in] times w [in, ...] -> [T, ...], on a CPU routed to the matmul that is fastest for T rows.

    With `cpu_kernel`, float32 steps of up to `cpu_matmul.MAX_ROWS` rows go to jaxserve's C++ kernel, which
    streams w at the memory's rate where XLA's dots fell to a fraction of it; with a `plan` too, only the row
    counts it names (those measured faster in the kernel on this machine). Otherwise XLA's CPU backend gives
    dots to YNNPACK, and Eigen runs the 2-16-row GEMMs of decode steps faster (docs/tuning.md). YNNPACK declines
    a dot whose left operand is column-major, so for those row counts x goes in transposed, behind an
    optimization barrier that keeps XLA from folding the transpose back into the dot.
    """
    t = x.shape[0]
    if cpu_kernel and (plan is None or plan.matmul(t)) and cpu_matmul.supports(x, w):
        return cpu_matmul.cpu_matmul(x, w)
    if 2 <= t <= CPU_EIGEN_MAX_ROWS and jax.default_backend() == "cpu":
        return lax.dot_general(lax.optimization_barrier(x.T), w, (((0,), (0,)), ((), ())))
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())))


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32 as HF does."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


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
        qkv, o, *bias = _normals(rngs.params(), shapes, dtype)
        self.qkv = nnx.Param(qkv)
        self.qkv_bias = nnx.Param(bias[0]) if bias else None
        self.o = nnx.Param(o)
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
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
        o = attention(q, k_cache, v_cache, meta, self.scale)
        return linear(o.reshape(t, -1), self.o[...], cpu_kernel, plan), (k_cache, v_cache)


class MLP(nnx.Module):
    """SwiGLU with a fused gate/up projection."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype, rngs: nnx.Rngs):
        hidden, inter = spec.hidden_size, spec.intermediate_size
        gate_up, down = _normals(rngs.params(), (((hidden, 2, inter), hidden**-0.5),
                                                 ((inter, hidden), inter**-0.5)), dtype)
        self.gate_up = nnx.Param(gate_up)
        self.down = nnx.Param(down)

    def __call__(self, x: jax.Array, cpu_kernel: bool = False, plan: KernelPlan | None = None) -> jax.Array:
        # A dot over [hidden, 2, inter] rather than a reshaped matmul: merging the "2" axis with the
        # tp-sharded intermediate axis made XLA all-gather the weight every step under tensor parallelism.
        gu = linear(x, self.gate_up[...], cpu_kernel, plan)
        return linear(jax.nn.silu(gu[:, 0]) * gu[:, 1], self.down[...], cpu_kernel, plan)


class DecoderLayer(nnx.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.attn = Attention(spec, dtype, rngs)
        self.post_attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.mlp = MLP(spec, dtype, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, kv: tuple[jax.Array, jax.Array],
                 meta: AttentionMetadata, cpu_kernel: bool, attention: AttentionBackend,
                 plan: KernelPlan | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        a, kv = self.attn(self.input_norm(x), cos, sin, kv, meta, cpu_kernel, attention, plan)
        x = x + a
        return x + self.mlp(self.post_attn_norm(x), cpu_kernel, plan), kv


class LlamaForCausalLM(nnx.Module):
    """The decoder stack, final norm and (tied or untied) LM head."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype | str = jnp.float32, *, rngs: nnx.Rngs):
        if spec.is_moe or spec.is_mla:
            raise ValueError(f"{spec.name}: MoE/MLA architectures ({spec.architecture}) are not supported")
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
        embed, *head = _normals(rngs.params(), tuple(shapes), dtype)
        self.embed = nnx.Param(embed)
        self.layers = nnx.List([DecoderLayer(spec, dtype, rngs) for _ in range(spec.num_layers)])
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
            attention = auto_backend(k0.dtype, k0.shape[3], k0.shape[1], cpu_kernel)
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
            return linear(hidden, self.lm_head[...], cpu_kernel).astype(jnp.float32)
        embed = self.embed[...]
        if cpu_kernel and cpu_matmul.supports_nt(hidden, embed):
            return cpu_matmul.cpu_matmul_nt(hidden, embed)
        return (hidden @ embed.T).astype(jnp.float32)


def init_kv_cache(spec: ModelSpec, num_pages: int, page_size: int,
                  dtype: jnp.dtype | str = jnp.float32) -> KVCaches:
    """Zeroed per-layer (k, v) page pools, each [num_pages, page_size, kv_heads, head_dim] (page 0: trash)."""
    dtype = resolve_dtype(dtype)
    shape = (num_pages, page_size, spec.num_kv_heads, spec.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(spec.num_layers)]


def kv_cache_bytes(spec: ModelSpec, num_pages: int, page_size: int,
                   dtype: jnp.dtype | str = jnp.float32) -> int:
    """Bytes `init_kv_cache` allocates (all layers, K and V); equals the planner's formula times tokens."""
    dtype = resolve_dtype(dtype)
    return 2 * spec.num_layers * num_pages * page_size * spec.num_kv_heads * spec.head_dim * dtype.itemsize


def planner_kv_bytes(spec: ModelSpec, num_pages: int, page_size: int, dtype: jnp.dtype | str) -> float:
    """The planner's prediction for the same pool (tp=1), for cross-checks."""
    return num_pages * page_size * kv_bytes_per_token(spec, planner_dtype(resolve_dtype(dtype)))
