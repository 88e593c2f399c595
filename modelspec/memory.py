"""Device memory model: weights, KV cache and activations per device.

One formula, two users: the planner predicts KV capacity with it, and the runtime sizes its KV pool with it
(`kv_pool_pages`), so the prediction and the pool cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from modelspec.dtypes import dtype_bytes, short_name
from modelspec.spec import ModelSpec

GIB = 1024**3


def kv_heads_per_device(spec: ModelSpec, tp: int) -> int:
    """KV heads each device holds; replicated (one per device) when tp > num_kv_heads."""
    return max(1, math.ceil(spec.num_kv_heads / tp))


# A KV pool of one-byte codes keeps one float32 scale per token per KV head (per latent row for MLA), beside the
# pages (the runtime's jaxserve/kernels/kv_quant.py).
SCALED_KV_DTYPES = ("int8", "fp8")
KV_SCALE_BYTES = 4.0


def kv_scale_bytes(kv_dtype: str) -> float:
    """Bytes of the scale each cached row (a token's KV head) carries in a `kv_dtype` pool: 0 for float pools."""
    return KV_SCALE_BYTES if short_name(kv_dtype) in SCALED_KV_DTYPES else 0.0


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str, tp: int = 1) -> float:
    """KV-cache bytes one token occupies on one device, all layers, scales included (int8/fp8 pools).

    MLA caches the compressed latent plus the rope key, which every TP rank needs whole (not divided by tp).
    """
    b, s = dtype_bytes(kv_dtype), kv_scale_bytes(kv_dtype)
    if spec.is_mla:
        return spec.num_layers * ((spec.kv_lora_rank + spec.qk_rope_head_dim) * b + s)
    return 2 * spec.num_layers * kv_heads_per_device(spec, tp) * (spec.head_dim * b + s)


def weight_bytes_per_device(spec: ModelSpec, dtype: str, tp: int = 1) -> float:
    """Weight bytes on one device under Megatron tensor parallelism.

    Projections, experts, embedding and lm_head are split tp ways; norms are replicated; k/v projections are
    replicated rather than split when tp > num_kv_heads; MLA's shared down-projections are replicated.
    """
    b = dtype_bytes(dtype)
    h = spec.hidden_size
    if spec.is_mla:
        replicated_attn = h * (spec.kv_lora_rank + spec.qk_rope_head_dim) + (h * spec.q_lora_rank)
        attn = replicated_attn + (spec.attention_params() - replicated_attn) / tp
    else:
        q_o = 2 * h * spec.num_heads * spec.head_dim / tp
        kv = 2 * h * kv_heads_per_device(spec, tp) * spec.head_dim
        bias = (spec.num_heads / tp + 2 * kv_heads_per_device(spec, tp)) * spec.head_dim if spec.qkv_bias else 0
        attn = q_o + kv + bias
    per_layer_norms = 2 * h
    total = spec.num_layers * (attn + per_layer_norms) + h
    total += spec.num_dense_layers * spec.dense_mlp_params() / tp
    if spec.is_moe:
        experts = (spec.num_experts + spec.num_shared_experts) * spec.expert_params() / tp
        total += spec.num_moe_layers * (experts + h * spec.num_experts)
    total += spec.embedding_params() / tp
    return total * b


def activation_bytes(spec: ModelSpec, num_tokens: int, max_num_seqs: int, dtype: str, tp: int = 1) -> float:
    """Peak activation workspace for one step of `num_tokens` tokens (largest live set, not a sum).

    The widest live tensors: the residual stream and norm output, the fused qkv, the fused gate/up, and the
    float32 logits of the sampled rows.
    """
    b = dtype_bytes(dtype)
    inter = (spec.moe_intermediate_size * max(1, spec.num_experts_per_tok) if spec.is_moe
             else spec.intermediate_size)
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.q_head_dim / tp
    per_token = (3 * spec.hidden_size + qkv + 3 * inter / tp) * b
    logits = max_num_seqs * spec.vocab_size * 4.0
    return num_tokens * per_token + logits


def kv_pool_pages(spec: ModelSpec, kv_budget_bytes: float, page_size: int, kv_dtype: str, tp: int = 1) -> int:
    """Pages of `page_size` tokens that fit in a per-device KV budget. The runtime sizes its pool with this."""
    page_bytes = page_size * kv_bytes_per_token(spec, kv_dtype, tp)
    return int(kv_budget_bytes // page_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-device memory split, in bytes, and the KV capacity it leaves."""

    weights: float
    kv: float
    activations: float
    total: float
    kv_bytes_per_token: float
    num_pages: int
    page_size: int

    @property
    def usable_pages(self) -> int:
        """Pages sequences can hold: the pool less its page 0, which the runtime (as vLLM its null block) keeps."""
        return max(0, self.num_pages - 1)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.usable_pages * self.page_size

    def max_concurrency(self, context_len: int) -> int:
        """Sequences of `context_len` tokens that fit at once (whole pages each)."""
        return self.usable_pages // max(1, math.ceil(context_len / self.page_size))

    def gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in asdict(self).items() if k in ("weights", "kv", "activations", "total")}


class DoesNotFitError(ValueError):
    """The model's weights and workspace leave no room for KV cache."""


def kv_budget_bytes(device_memory_bytes: float, gpu_memory_utilization: float, weights: float,
                    activations: float) -> float:
    """The KV budget of one device as vLLM's --gpu-memory-utilization makes it: the instance's share of the
    device's total memory, less the weights and the activation peak of a step of max_num_batched_tokens (vLLM
    also subtracts its non-torch memory, NCCL and library workspaces, 0.1-1.4 GiB in its logs; the runtime has
    none outside XLA's own buffers). The planner and the runtime both size their pools with this."""
    return device_memory_bytes * gpu_memory_utilization - weights - activations


def plan_memory(spec: ModelSpec, device_memory_bytes: float, *, tp: int = 1, dtype: str = "bf16",
                kv_dtype: str | None = None, page_size: int = 16, chunk_size: int = 2048,
                max_num_seqs: int = 256, gpu_memory_utilization: float = 0.9) -> MemoryPlan:
    """Split `gpu_memory_utilization` of a device's memory into weights, activations and KV pages
    (`kv_budget_bytes`); `chunk_size` is the step budget, max_num_batched_tokens."""
    kv_dtype = kv_dtype or dtype
    weights = weight_bytes_per_device(spec, dtype, tp)
    acts = activation_bytes(spec, chunk_size, max_num_seqs, dtype, tp)
    budget = kv_budget_bytes(device_memory_bytes, gpu_memory_utilization, weights, acts)
    if budget <= 0:
        raise DoesNotFitError(
            f"{spec.name} does not fit at tp={tp} in {dtype}: weights {weights / GIB:.1f} GiB + workspace "
            f"{acts / GIB:.1f} GiB exceed {gpu_memory_utilization:.0%} of {device_memory_bytes / GIB:.1f} GiB")
    pages = kv_pool_pages(spec, budget, page_size, kv_dtype, tp)
    kv_per_tok = kv_bytes_per_token(spec, kv_dtype, tp)
    kv = pages * page_size * kv_per_tok
    return MemoryPlan(weights=weights, kv=kv, activations=acts, total=weights + kv + acts,
                      kv_bytes_per_token=kv_per_tok, num_pages=pages, page_size=page_size)
