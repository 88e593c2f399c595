"""Tensor parallelism: the device mesh, parameter and KV shardings, and KV-head replication at load time.

A mesh has one axis, "tp". Parameters follow the declarative table in `jaxserve.model.weights`
(`PARTITION_SPECS`: column-parallel qkv by KV head and gate/up, row-parallel o and down, vocab-parallel embedding
and head, replicated norms); the KV pool `[num_pages, page_size, kv_heads, head_dim]` is sharded on kv_heads.
XLA's SPMD partitioner inserts the all-reduces after the row-parallel matmuls. MoE layers are tensor parallel
too: every expert's intermediate axis is split (`jaxserve.model.moe`), the router replicated.

When tp exceeds the model's KV heads (e.g. 2 KV heads on 4 devices), each KV head is replicated
`r = tp / kv_heads` times at load time: the fused qkv `[hidden, kv_heads, group + 2, head_dim]` is re-laid as
`[hidden, tp, group / r + 2, head_dim]`, where new KV head `j * r + i` carries query heads
`i * group / r ... (i + 1) * group / r - 1` of old KV head j plus a copy of its key and value. Query heads keep
their HF order, so `o` is untouched. The model then runs as if it had `tp` KV heads (`effective_spec`), one per
device, which is what the planner's `kv_heads_per_device` models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.model.weights import partition_spec
from modelspec.spec import ModelSpec

AXIS = "tp"
KV_SPEC = P(None, None, AXIS, None)


def check_tp(spec: ModelSpec, tp: int) -> None:
    """Raise ValueError when `spec` cannot be split `tp` ways (heads, or KV heads either way, must divide)."""
    if tp == 1:
        return
    if spec.is_mla:
        raise ValueError(f"{spec.name}: tensor parallelism does not support MLA (latent attention) yet")
    if spec.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the number of attention heads "
                         f"({spec.num_heads}) of {spec.name}")
    kvh = spec.num_kv_heads
    if kvh % tp and tp % kvh:
        raise ValueError(f"tensor_parallel_size {tp} and the {kvh} KV heads of {spec.name} must divide one "
                         "another")


def effective_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The spec the runtime runs: `num_kv_heads` raised to `tp` when KV heads are replicated."""
    check_tp(spec, tp)
    if tp <= spec.num_kv_heads:
        return spec
    return dataclasses.replace(spec, num_kv_heads=tp)


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A one-axis ("tp") mesh over `devices`."""
    return Mesh(np.array(list(devices)), (AXIS,))


def select_devices(tp: int, device_ids: Sequence[int] = ()) -> list[jax.Device]:
    """The devices of one engine: `device_ids` (indices into `jax.devices()`), else the first `tp`."""
    devices = jax.devices()
    ids = list(device_ids) or list(range(tp))
    if len(ids) != tp:
        raise ValueError(f"{len(ids)} device ids given for tensor_parallel_size {tp}")
    if max(ids) >= len(devices) or min(ids) < 0:
        raise ValueError(f"device ids {ids} need {max(ids) + 1} devices; {len(devices)} visible "
                         f"({devices[0]}, ...)")
    return [devices[i] for i in ids]


def fit_spec(pspec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """`pspec` with the tp axis dropped from any dimension it does not divide (that dimension is replicated)."""
    size = mesh.shape[AXIS]
    axes = tuple(a if a is None or shape[i] % size == 0 else None for i, a in enumerate(pspec))
    return P(*axes)


def param_sharding(path: str, shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """The sharding of the parameter at dotted `path` (see `PARTITION_SPECS`)."""
    return NamedSharding(mesh, fit_spec(partition_spec(path), shape, mesh))


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """KV pages sharded on their kv_heads axis."""
    return NamedSharding(mesh, KV_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put_global(value: np.ndarray | jax.Array, sharding: NamedSharding) -> jax.Array:
    """Place a whole (host-visible) array onto `sharding`; works when the mesh spans several processes."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _path_str(path: tuple) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def replicate_kv_heads(model: nnx.Module, spec: ModelSpec, tp: int) -> None:
    """Re-lay every layer's fused qkv (and bias) in place so the model has `tp` KV heads (see module doc)."""
    kvh = spec.num_kv_heads
    if tp <= kvh:
        return
    r = tp // kvh
    g = spec.num_heads // kvh
    gr = g // r
    for layer in model.layers:
        attn = layer.attn
        attn.qkv.set_value(_relay(attn.qkv[...], r, g, gr, leading=1))
        if attn.qkv_bias is not None:
            attn.qkv_bias.set_value(_relay(attn.qkv_bias[...], r, g, gr, leading=0))
        attn.num_kv_heads, attn.group = tp, gr


def _relay(w: jax.Array, r: int, g: int, gr: int, leading: int) -> jax.Array:
    """[..., kvh, g + 2, d] -> [..., kvh * r, gr + 2, d] (query slots split r ways, k and v copied)."""
    kvh, d = w.shape[leading], w.shape[-1]
    lead = w.shape[:leading]
    q = w[..., :g, :].reshape(*lead, kvh, r, gr, d)
    kv = jnp.broadcast_to(w[..., None, g:, :], (*lead, kvh, r, 2, d))
    return jnp.concatenate([q, kv], axis=-2).reshape(*lead, kvh * r, gr + 2, d)


def shard_model(model: nnx.Module, mesh: Mesh) -> None:
    """Move every parameter of `model` onto its tensor-parallel sharding over `mesh`, in place."""
    state = nnx.state(model)
    for path, leaf in nnx.to_flat_state(state):
        value = leaf.get_value()
        leaf.set_value(put_global(value, param_sharding(_path_str(path), tuple(value.shape), mesh)))
    nnx.update(model, state)


def params_shardings(params: nnx.State) -> nnx.State:
    """The sharding of every leaf of a parameter state (for a jit's in/out shardings)."""
    return jax.tree.map(lambda x: x.sharding, params)
