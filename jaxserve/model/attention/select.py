"""The one place an attention backend is chosen: at start-up, from the engine's `--attention-backend` and what
the device, dtype and shapes allow. Nothing on the step path looks at the platform again.

- auto: on a CPU, the C++ kernel where it can run (float32, a head dimension it is built for, the kernels built,
  one device), else the reference with a CPU's tuning; on a GPU, the Pallas kernel where it can run (see
  `pallas.supports`; one device), else the reference with an accelerator's tuning; elsewhere that reference.
- reference / cpu / pallas: that backend, or a ValueError saying why it cannot run here. `pallas` on a CPU runs
  the kernel in Pallas' interpreter: for tests and debugging, far too slow to serve.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jaxserve.config.engine import ATTENTION_BACKENDS
from jaxserve.kernels.cpu import attention as cpu_attention
from jaxserve.kernels.cpu.attention_backend import CpuKernelAttention
from jaxserve.kernels.gpu import ragged_paged_attention as pallas
from jaxserve.kernels.gpu.ragged_paged_attention import PallasAttention
from jaxserve.model.attention.backend import AttentionBackend
from jaxserve.model.attention.kv_quant import kv_kind as kv_kind  # the runner asks its pool here
from jaxserve.model.attention.reference import ACCELERATOR_TUNING, CPU_TUNING, reference_for

logger = logging.getLogger(__name__)

GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _cpu_kernel_refusal(platform: str, dtype: jnp.dtype, head_dim: int, cpu_kernels: bool,
                        kv_cache_dtype: str = "auto") -> str | None:
    """Why the C++ kernel cannot run here, or None when it can."""
    if platform != "cpu":
        return f"it runs on a CPU, not on {platform}"
    if not cpu_kernels:
        return "the CPU kernels are off (--no-cpu-kernels, or a mesh of several devices)"
    if not cpu_attention.supports(dtype, head_dim):
        return (f"it needs float32 and a head dimension in {cpu_attention.HEAD_DIMS} and the kernels built "
                f"(got {jnp.dtype(dtype).name}, head_dim {head_dim})")
    if kv_cache_dtype not in cpu_attention.KV_CACHE_DTYPES:
        return f"it reads KV pages of --kv-cache-dtype {'/'.join(cpu_attention.KV_CACHE_DTYPES)}, not {kv_cache_dtype}"
    return None


def _pallas_refusal(platform: str, dtype: jnp.dtype, head_dim: int, page_size: int, num_devices: int,
                    kv_cache_dtype: str = "auto") -> str | None:
    """Why the Pallas kernel cannot run here, or None when it can."""
    if platform not in GPU_PLATFORMS + ("cpu",):
        return f"it is written for NVIDIA GPUs (Pallas-Triton), not {platform}"
    if num_devices > 1:
        return f"it runs on one device; this engine's mesh has {num_devices} (tensor parallelism)"
    if pallas.plgpu is None:
        return f"this jax ({jax.__version__}) has no Pallas-Triton (jax.experimental.pallas.triton)"
    if not pallas.supports(dtype, head_dim, page_size):
        return (f"it needs float32, bfloat16 or float16, a power-of-two head_dim >= 16 and a power-of-two page "
                f"size (got {jnp.dtype(dtype).name}, head_dim {head_dim}, page size {page_size})")
    if kv_cache_dtype not in pallas.KV_CACHE_DTYPES:
        return f"it reads KV pages of --kv-cache-dtype {'/'.join(pallas.KV_CACHE_DTYPES)}, not {kv_cache_dtype}"
    return None


def select_backend(name: str, platform: str, dtype: jnp.dtype, head_dim: int, page_size: int, *,
                   cpu_kernels: bool = True, num_devices: int = 1, kv_cache_dtype: str = "auto") -> AttentionBackend:
    """The backend `name` (one of ATTENTION_BACKENDS) resolves to on `platform` ("cpu", "gpu", "tpu", ...) for a
    KV pool of `dtype` (the model's), `head_dim` and `page_size` spread over `num_devices`, its pages stored as
    `kv_cache_dtype` ("auto": in `dtype`; "int8"/"fp8": `kv_quant` codes, which every backend here reads);
    `cpu_kernels`: whether jaxserve's C++ kernels may run (the engine's flag, and one device). Raises ValueError
    for a name or an explicit choice that cannot run here."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, not {name!r}")
    cpu_no = _cpu_kernel_refusal(platform, dtype, head_dim, cpu_kernels, kv_cache_dtype)
    pallas_no = _pallas_refusal(platform, dtype, head_dim, page_size, num_devices, kv_cache_dtype)
    if name == "auto":
        if platform == "cpu":
            return CpuKernelAttention() if cpu_no is None else CPU_TUNING
        if platform in GPU_PLATFORMS and pallas_no is None:
            return PallasAttention()
        return ACCELERATOR_TUNING
    if name == "reference":
        return reference_for(platform)
    if name == "cpu":
        if cpu_no is not None:
            raise ValueError(f"attention backend 'cpu' cannot run here: {cpu_no}")
        return CpuKernelAttention()
    if pallas_no is not None:
        raise ValueError(f"attention backend 'pallas' cannot run here: {pallas_no}")
    if platform == "cpu":
        logger.warning("attention backend 'pallas' on a CPU runs in Pallas' interpreter: tests only, very slow")
        return PallasAttention(interpret=True)
    return PallasAttention()


def auto_backend(dtype: jnp.dtype, head_dim: int, page_size: int, cpu_kernels: bool = True,
                 kv_cache_dtype: str = "auto") -> AttentionBackend:
    """What `auto` picks on this process's default platform, for callers that run the model without an engine
    (tests, scripts): the same choice, made where the model is traced."""
    return select_backend("auto", jax.default_backend(), dtype, head_dim, page_size, cpu_kernels=cpu_kernels,
                          kv_cache_dtype=kv_cache_dtype)


def finest_chunk(page_size: int) -> int:
    """The finest prefill chunk any backend schedules (a bound for checks made before an engine exists)."""
    backends = (CPU_TUNING, ACCELERATOR_TUNING, CpuKernelAttention(), PallasAttention())
    return min(page_size, *(min(b.q_blocks) for b in backends))
