"""Builds what the model runner needs: the model's parameters, the KV pool sized by the planner's formula,
and the context length that pool allows, all placed on the engine's device mesh (axis "tp").

With tensor parallelism the parameters are sharded per `PARTITION_SPECS`, KV heads are replicated at load time
when tp exceeds them (`jaxserve.runner.parallel`), and the pool holds `kv_heads_per_device` heads per device, which is
exactly what the planner's `kv_pool_pages(..., tp)` assumes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config.engine import EngineConfig
from jaxserve.kernels.kv_quant import QuantizedPool, empty_pool
from jaxserve.model.checkpoint import load_checkpoint
from jaxserve.model.compressed_tensors import folder_scheme
from jaxserve.model.dtypes import resolve_dtype
from jaxserve.model.llama import KVCaches, kv_pool_layout
from jaxserve.model.quantize_model import quantize_model
from jaxserve.model.synthetic import synthetic_model
from jaxserve.platform.devices import memory_limit
from jaxserve.platform.policy import default_dtype_of
from jaxserve.runner import compilation_cache
from jaxserve.runner.parallel import (
    AXIS,
    effective_spec,
    kv_sharding,
    make_mesh,
    replicate_kv_heads,
    replicated,
    select_devices,
    shard_model,
)
from modelspec.memory import GIB, activation_bytes, kv_bytes_per_token, kv_pool_pages, weight_bytes_per_device
from modelspec.memory import kv_budget_bytes as kv_budget
from modelspec.spec import ModelSpec, resolve_model_path

CPU_DEFAULT_KV_BYTES = 1 * GIB
_DTYPE_NAMES = {jnp.dtype(jnp.float32): "fp32", jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "fp16"}


@dataclass
class BuiltModel:
    model: nnx.Module
    kv_caches: Any
    dtype: jnp.dtype
    num_pages: int  # including the trash page 0
    max_model_len: int
    mesh: jax.sharding.Mesh | None = None  # the engine's devices, axis "tp"
    spec: ModelSpec | None = None  # what runs: num_kv_heads raised to tp when KV heads are replicated


def load_model(config: EngineConfig, spec: ModelSpec, dtype: jnp.dtype,
               mesh: jax.sharding.Mesh | None = None) -> nnx.Module:
    """Seeded random weights for synthetic presets; otherwise read the checkpoint folder.

    A checkpoint is read straight onto `mesh`, tensor by tensor, when every sharded axis divides evenly and the
    mesh is local; otherwise it is read onto one device and sharded afterwards (`shard_model`).
    """
    if spec.synthetic:
        return synthetic_model(spec, dtype, config.seed)

    tp = mesh.devices.size if mesh is not None else 1
    local = mesh is not None and all(d.process_index == jax.process_index() for d in mesh.devices.flat)
    direct = local and all(n % tp == 0 for n in (spec.num_kv_heads, spec.vocab_size, spec.intermediate_size,
                                                 spec.moe_intermediate_size))
    path = os.path.expanduser(resolve_model_path(config.model))
    return load_checkpoint(path, spec, dtype, mesh=mesh if direct else None)


def kv_budget_bytes(config: EngineConfig, spec: ModelSpec, dtype_name: str,
                    device: jax.Device | None = None) -> float:
    """The KV budget per device: explicit, else a fraction of accelerator memory, else a CPU default.

    On CPU the default is 1 GiB, or less when `max_num_seqs` full-length sequences need less.
    """
    if config.kv_cache_memory is not None:
        return float(config.kv_cache_memory)
    device = device or jax.devices()[0]
    limit = memory_limit(device)
    if limit is not None:  # the device's memory as XLA's allocator holds it, the planner's formula
        tp = config.tensor_parallel_size
        free = kv_budget(limit, config.gpu_memory_utilization,
                         weight_bytes_per_device(spec, config.quantization or dtype_name, tp),
                         activation_bytes(spec, config.max_num_batched_tokens, config.max_num_seqs, dtype_name, tp))
        if free <= 0:
            raise ValueError(f"{spec.name} leaves no memory for the KV cache at "
                             f"gpu_memory_utilization={config.gpu_memory_utilization}")
        return free
    context = config.max_model_len or spec.max_position_embeddings
    needed = ((config.max_num_seqs * context + config.page_size)
              * kv_bytes_per_token(spec, kv_dtype_name(config, dtype_name), config.tensor_parallel_size))
    return min(CPU_DEFAULT_KV_BYTES, needed)


def checkpoint_quantization(config: EngineConfig, spec: ModelSpec) -> str | None:
    """The weight format a pre-quantized (compressed-tensors) checkpoint holds, written into `config.quantization`
    (what the engine runs, and calibrate and report price); None for float checkpoints and presets. ValueError
    when it conflicts with an explicit --quantization or asks for several devices (codes are not in the sharding
    table), or when the checkpoint's scheme is not supported."""
    if spec.synthetic:
        return None
    scheme = folder_scheme(os.path.expanduser(resolve_model_path(config.model)))
    if scheme is None:
        return None
    if config.quantization not in (None, scheme.method):
        raise ValueError(f"--quantization {config.quantization} conflicts with the checkpoint's {scheme.method} "
                         "weights (compressed-tensors); drop the flag")
    if config.tensor_parallel_size > 1 or config.disaggregate:
        raise ValueError(f"the checkpoint's {scheme.method} weights run on one device (not with "
                         "tensor_parallel_size > 1 or disaggregate)")
    config.quantization = scheme.method
    return scheme.method


def build_model_and_cache(config: EngineConfig, spec: ModelSpec) -> BuiltModel:
    """Model parameters on the device, an empty KV pool, and the resulting max_model_len."""
    compilation_cache.enable_compilation_cache(config.compilation_cache_dir)
    if config.max_model_len is not None and config.max_model_len > spec.max_position_embeddings:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's maximum positions "
                         f"({spec.max_position_embeddings})")
    tp = config.tensor_parallel_size
    run_spec = effective_spec(spec, tp)
    devices = select_devices(tp, config.device_ids)
    mesh = make_mesh(devices)
    dtype = default_dtype_of(devices) if config.dtype == "auto" else resolve_dtype(config.dtype)
    dtype_name = _DTYPE_NAMES[jnp.dtype(dtype)]
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if not local:
        raise ValueError(f"process {jax.process_index()} holds none of the {tp} mesh devices; with several "
                         f"processes, tensor_parallel_size must span every process ({len(jax.devices())} devices)")
    budget = kv_budget_bytes(config, spec, dtype_name, local[0])
    num_pages = kv_pool_pages(spec, budget, config.page_size, kv_dtype_name(config, dtype_name), tp)
    usable_tokens = (num_pages - 1) * config.page_size
    if usable_tokens < config.page_size:
        raise ValueError("the KV cache budget holds less than one page; raise kv_cache_memory")
    max_model_len = config.max_model_len or min(spec.max_position_embeddings, usable_tokens)
    if max_model_len > usable_tokens:
        raise ValueError(f"max_model_len {max_model_len} needs {max_model_len} KV slots but the pool holds "
                         f"{usable_tokens}; raise kv_cache_memory or lower max_model_len")
    held = checkpoint_quantization(config, spec)
    model = load_model(config, spec, dtype, mesh)
    replicate_kv_heads(model, spec, tp)
    if held:  # one device: codes and scales (not in the sharding table) and the rest replicated on it
        nnx.update(model, jax.device_put(nnx.state(model), replicated(mesh)))
    else:
        shard_model(model, mesh)
    if config.quantization and not held:  # after placement: one device (EngineConfig refuses tp > 1)
        quantize_model(model, config.quantization)
    kv_caches = init_sharded_kv_cache(run_spec, num_pages, config.page_size, dtype, mesh, config.kv_cache_dtype)
    return BuiltModel(model=model, kv_caches=kv_caches, dtype=jnp.dtype(dtype), num_pages=num_pages,
                      max_model_len=max_model_len, mesh=mesh, spec=run_spec)


def kv_dtype_name(config: EngineConfig, dtype_name: str) -> str:
    """The planner's name of the KV pool's dtype: `--kv-cache-dtype`, or the model's (`dtype_name`) for auto."""
    return dtype_name if config.kv_cache_dtype == "auto" else config.kv_cache_dtype


def init_sharded_kv_cache(spec: ModelSpec, num_pages: int, page_size: int, dtype: jnp.dtype,
                          mesh: jax.sharding.Mesh, kv_cache_dtype: str = "auto") -> KVCaches:
    """Zeroed per-layer (k, v) pools `[num_pages, page_size, kv_heads, head_dim]`, sharded on kv_heads (MLA: one
    latent pool a layer, `llama.kv_pool_layout`); for int8/fp8 each a `kv_quant.QuantizedPool` of codes and
    per-row float32 scales (their bytes are the planner's `kv_bytes_per_token` of that dtype).

    Each device allocates only its own shard (no full pool is ever built on one device).
    """
    shape, n = kv_pool_layout(spec, num_pages, page_size)
    if kv_cache_dtype == "auto":
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=kv_sharding(mesh))
    else:
        sharding = QuantizedPool(kv_sharding(mesh), NamedSharding(mesh, P(None, None, AXIS)), jnp.dtype(dtype))
        zeros = jax.jit(lambda: empty_pool(shape, kv_cache_dtype, dtype), out_shardings=sharding)
    return [tuple(zeros() for _ in range(n)) for _ in range(spec.num_layers)]
