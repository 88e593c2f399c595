"""Building blocks every decoder family shares: the seeded initializer, the routed matmul, RMSNorm, SwiGLU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxserve.kernels.cpu import matmul as cpu_matmul
from jaxserve.kernels.cpu import matmul_int8 as cpu_matmul_int8
from jaxserve.kernels.gpu.matvec import matvec
from jaxserve.model.ops import XLA_MATMULS, MatmulRoute
from jaxserve.model.quantize import QuantizedWeight, fp8_matmul, quantized_matmul
from modelspec.spec import ModelSpec


def normals(key: jax.Array, shapes_stds: tuple[tuple[tuple[int, ...], float], ...],
            dtype: jnp.dtype) -> list[jax.Array]:
    """Seeded normal arrays for (shape, std) pairs.

    Drawn on the host with numpy, seeded from the key's data: no XLA compile (threefry kernels take seconds
    to compile per shape on CPU) and the same values on every platform. Under a trace (`nnx.eval_shape`, or the
    jitted draw of a large synthetic model, `model/synthetic.py`) the key is abstract and `hashed_uniform`, a
    uniform of the same std, stands in.
    """
    if isinstance(key, jax.core.Tracer):
        keys = jax.random.split(key, len(shapes_stds))
        return [hashed_uniform(k, shape, std, dtype) for k, (shape, std) in zip(keys, shapes_stds, strict=True)]
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    return [jnp.asarray((rng.standard_normal(shape, dtype=np.float32) * np.float32(std)), dtype=dtype)
            for shape, std in shapes_stds]


def hashed_uniform(key: jax.Array, shape: tuple[int, ...], std: float, dtype: jnp.dtype) -> jax.Array:
    """A uniform array of standard deviation `std`: each element a hash (murmur3's finalizer) of its flat index
    and the key's data. Integer ops and one exact scaling: one cheap elementwise kernel, and the same values on
    every platform (unlike threefry's normals, whose inverse erf rounds per platform)."""
    seed = jax.random.key_data(key).ravel().astype(jnp.uint32)
    size = int(np.prod(shape))
    h = lax.iota(jnp.uint32, size).reshape(shape) * jnp.uint32(0x9E3779B1) ^ seed[0]
    h = h + seed[-1]
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = (h ^ (h >> shift)) * jnp.uint32(mult)
    h = h ^ (h >> 16)
    unit = (h >> 8).astype(jnp.float32) * np.float32(2.0**-24) - np.float32(0.5)  # [-1/2, 1/2), variance 1/12
    return (unit * np.float32(std * 12**0.5)).astype(dtype)


def linear(x: jax.Array, w: jax.Array | QuantizedWeight, route: MatmulRoute = XLA_MATMULS) -> jax.Array:
    """x [T, in] times w [in, ...] -> [T, ...], by the matmul `route` names for T rows (`ops.MatmulRoute`).

    With the route's C++ kernel, float32 steps of up to `cpu_matmul.MAX_ROWS` rows go to jaxserve's kernel, which
    streams w at the memory's rate where XLA's dots fell to a fraction of it (at the row counts the route's plan
    measured faster on this machine). At the route's transposed row counts x goes in transposed, behind an
    optimization barrier that keeps XLA from folding the transpose back into the dot: YNNPACK declines a dot whose
    left operand is column-major, and Eigen runs those GEMMs faster (docs/tuning.md). An int8 `QuantizedWeight`
    (`--quantization int8`) is multiplied as codes, its scales applied to the output: in the int8 kernel (codes
    converted in registers) where the route allows, else in XLA (`quantize.quantized_matmul`).
    """
    t = x.shape[0]
    if route.matvec_at(t):
        return gpu_matvec(x, w, route.matvec_interpret)
    if isinstance(w, QuantizedWeight):
        if route.kernel_at(t) and cpu_matmul_int8.supports(x, w.q):
            return cpu_matmul_int8.cpu_matmul_int8(x, w.q, w.scale, route.int8_threads(t))
        if route.fp8_activations and w.q.dtype == jnp.float8_e4m3fn:
            return fp8_matmul(x, w)
        return quantized_matmul(x, w, in_step_order=route.step_order_converts)
    if route.kernel_at(t) and cpu_matmul.supports(x, w):
        return cpu_matmul.cpu_matmul(x, w, route.row_parts_at(t))
    if route.transposed_at(t):
        return lax.dot_general(lax.optimization_barrier(x.T), w, (((0,), (0,)), ((), ())))
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())))


def gpu_matvec(x: jax.Array, w: jax.Array | QuantizedWeight, interpret: bool = False) -> jax.Array:
    """x [T, in] @ w [in, ...] in the GPU few-row matmul (`kernels/gpu/matvec.py`): codes and their scales for a
    `QuantizedWeight`, read once in their stored dtype."""
    q, scales = (w.q, w.scale) if isinstance(w, QuantizedWeight) else (w, None)
    out = matvec(x, q.reshape(q.shape[0], -1), None if scales is None else scales.reshape(-1), interpret=interpret)
    return out.reshape(x.shape[0], *q.shape[1:])


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32 as HF does."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)



class MLP(nnx.Module):
    """SwiGLU with a fused gate/up projection."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype, rngs: nnx.Rngs, intermediate_size: int | None = None):
        hidden, inter = spec.hidden_size, intermediate_size or spec.intermediate_size
        gate_up, down = normals(rngs.params(), (((hidden, 2, inter), hidden**-0.5),
                                                 ((inter, hidden), inter**-0.5)), dtype)
        self.gate_up = nnx.Param(gate_up)
        self.down = nnx.Param(down)

    def __call__(self, x: jax.Array, route: MatmulRoute = XLA_MATMULS) -> jax.Array:
        # A dot over [hidden, 2, inter] rather than a reshaped matmul: merging the "2" axis with the
        # tp-sharded intermediate axis made XLA all-gather the weight every step under tensor parallelism.
        gu = linear(x, self.gate_up[...], route)
        return linear(jax.nn.silu(gu[:, 0]) * gu[:, 1], self.down[...], route)
