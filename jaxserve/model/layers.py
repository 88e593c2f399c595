"""Building blocks every decoder family shares: the seeded initializer, the CPU-routed matmul, RMSNorm, SwiGLU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxserve.kernels.cpu import matmul as cpu_matmul
from jaxserve.kernels.cpu import matmul_int8 as cpu_matmul_int8
from jaxserve.kernels.cpu.kernel_plan import KernelPlan
from jaxserve.model.quantize import QuantizedWeight, quantized_matmul
from modelspec.spec import ModelSpec

# Token counts up to which a CPU step's projections go to Eigen rather than YNNPACK (`linear`); see docs/tuning.md.
CPU_EIGEN_MAX_ROWS = 16


def normals(key: jax.Array, shapes_stds: tuple[tuple[tuple[int, ...], float], ...],
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


def linear(x: jax.Array, w: jax.Array | QuantizedWeight, cpu_kernel: bool = False,
           plan: KernelPlan | None = None) -> jax.Array:
    """x [T, in] times w [in, ...] -> [T, ...], on a CPU routed to the matmul that is fastest for T rows.

    With `cpu_kernel`, float32 steps of up to `cpu_matmul.MAX_ROWS` rows go to jaxserve's C++ kernel, which
    streams w at the memory's rate where XLA's dots fell to a fraction of it; with a `plan` too, only the row
    counts it names (those measured faster in the kernel on this machine). Otherwise XLA's CPU backend gives
    dots to YNNPACK, and Eigen runs the 2-16-row GEMMs of decode steps faster (docs/tuning.md). YNNPACK declines
    a dot whose left operand is column-major, so for those row counts x goes in transposed, behind an
    optimization barrier that keeps XLA from folding the transpose back into the dot. An int8 `QuantizedWeight`
    (`--quantization int8`) is multiplied as codes, its scales applied to the output: in the int8 kernel (codes
    converted in registers) where the kernel and plan allow, else in XLA (`quantize.quantized_matmul`).
    """
    t = x.shape[0]
    if isinstance(w, QuantizedWeight):
        if cpu_kernel and (plan is None or plan.matmul(t)) and cpu_matmul_int8.supports(x, w.q):
            return cpu_matmul_int8.cpu_matmul_int8(x, w.q, w.scale, plan.int8_threads(t) if plan else 0)
        return quantized_matmul(x, w, in_step_order=cpu_kernel)  # a CPU step: one weight's float copy at a time
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



class MLP(nnx.Module):
    """SwiGLU with a fused gate/up projection."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype, rngs: nnx.Rngs, intermediate_size: int | None = None):
        hidden, inter = spec.hidden_size, intermediate_size or spec.intermediate_size
        gate_up, down = normals(rngs.params(), (((hidden, 2, inter), hidden**-0.5),
                                                 ((inter, hidden), inter**-0.5)), dtype)
        self.gate_up = nnx.Param(gate_up)
        self.down = nnx.Param(down)

    def __call__(self, x: jax.Array, cpu_kernel: bool = False, plan: KernelPlan | None = None) -> jax.Array:
        # A dot over [hidden, 2, inter] rather than a reshaped matmul: merging the "2" axis with the
        # tp-sharded intermediate axis made XLA all-gather the weight every step under tensor parallelism.
        gu = linear(x, self.gate_up[...], cpu_kernel, plan)
        return linear(jax.nn.silu(gu[:, 0]) * gu[:, 1], self.down[...], cpu_kernel, plan)
