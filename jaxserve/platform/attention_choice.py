"""How the platform policy chooses the attention backend: at start-up, from the engine's `--attention-backend` and
what the device, dtype and shapes allow. Nothing on the step path looks at the platform again.

- auto: on a CPU, the C++ kernel where it can run (float32, a head dimension it is built for, the kernels built,
  one device), else the reference with a CPU's tuning; on a GPU, the Pallas kernels where they can run (see
  `pallas.supports`): decodes split over the KV (`pallas-split`, flash-decoding, so a lone long decode fills the
  device) and the rest in one ragged call; else the reference with an accelerator's tuning; elsewhere that
  reference. On a mesh of several devices the policy runs a Pallas kernel under `shard_map`
  (model/attention/sharded.py).
- reference / cpu / pallas / pallas-split: that backend, or a ValueError saying why it cannot run here. `pallas`
  is the ragged kernel alone (decodes included). The Pallas backends on a CPU run in Pallas' interpreter: for
  tests and debugging, far too slow to serve.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jaxserve.config.engine import ATTENTION_BACKENDS
from jaxserve.kernels.cpu import attention as cpu_attention
from jaxserve.kernels.gpu import ragged_paged_attention as pallas
from jaxserve.kernels.gpu.ragged_paged_attention import PallasAttention
from jaxserve.kernels.gpu.split_kv_decode import H200_SMS, SplitKvAttention
from jaxserve.kernels.kv_quant import kv_kind as kv_kind  # the runner asks its pool here
from jaxserve.model.attention.backend import AttentionBackend
from jaxserve.model.attention.cpu_kernel import CpuKernelAttention
from jaxserve.model.attention.reference import ACCELERATOR_TUNING, CPU_TUNING, ReferenceAttention

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
    if pallas.plgpu is None:
        return f"this jax ({jax.__version__}) has no Pallas-Triton (jax.experimental.pallas.triton)"
    if not pallas.supports(dtype, head_dim, page_size):
        return (f"it needs float32, bfloat16 or float16, a power-of-two head_dim >= 16 and a power-of-two page "
                f"size (got {jnp.dtype(dtype).name}, head_dim {head_dim}, page size {page_size})")
    if kv_cache_dtype not in pallas.KV_CACHE_DTYPES:
        return f"it reads KV pages of --kv-cache-dtype {'/'.join(pallas.KV_CACHE_DTYPES)}, not {kv_cache_dtype}"
    return None


def select_backend(name: str, platform: str, dtype: jnp.dtype, head_dim: int, page_size: int, *,
                   cpu_kernels: bool = True, num_devices: int = 1, kv_cache_dtype: str = "auto",
                   num_sms: int | None = None) -> AttentionBackend:
    """The backend `name` (one of ATTENTION_BACKENDS) resolves to on `platform` ("cpu", "gpu", "tpu", ...) for a
    KV pool of `dtype` (the model's), `head_dim` and `page_size` spread over `num_devices`, its pages stored as
    `kv_cache_dtype` ("auto": in `dtype`; "int8"/"fp8": `kv_quant` codes, which every backend here reads);
    `cpu_kernels`: whether jaxserve's C++ kernels may run (the engine's flag, and one device); `num_sms`: the
    GPU's multiprocessors, which the split-KV kernel fills (None: an H200's). Raises ValueError for a name or an
    explicit choice that cannot run here. `num_devices` is accepted for the caller's sake: a Pallas kernel runs on a
    mesh under `shard_map`, which the policy adds."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, not {name!r}")
    cpu_no = _cpu_kernel_refusal(platform, dtype, head_dim, cpu_kernels, kv_cache_dtype)
    pallas_no = _pallas_refusal(platform, dtype, head_dim, page_size, num_devices, kv_cache_dtype)
    if name == "auto":
        if platform == "cpu":
            return CpuKernelAttention() if cpu_no is None else CPU_TUNING
        if platform in GPU_PLATFORMS and pallas_no is None:
            return SplitKvAttention(num_sms=num_sms or H200_SMS)
        return ACCELERATOR_TUNING
    if name == "reference":
        return reference_for(platform)
    if name == "cpu":
        if cpu_no is not None:
            raise ValueError(f"attention backend 'cpu' cannot run here: {cpu_no}")
        return CpuKernelAttention()
    if pallas_no is not None:
        raise ValueError(f"attention backend {name!r} cannot run here: {pallas_no}")
    interpret = platform == "cpu"
    if interpret:
        logger.warning("attention backend %r on a CPU runs in Pallas' interpreter: tests only, very slow", name)
    if name == "pallas-split":
        return SplitKvAttention(num_sms=num_sms or H200_SMS, interpret=interpret)
    return PallasAttention(interpret=interpret)


def reference_for(platform: str) -> ReferenceAttention:
    """The reference backend tuned for `platform` ("cpu", or an accelerator's: "gpu", "cuda", "tpu", ...)."""
    return CPU_TUNING if platform == "cpu" else ACCELERATOR_TUNING


def finest_chunk(page_size: int) -> int:
    """The finest prefill chunk any backend schedules (a bound for checks made before an engine exists)."""
    backends = (CPU_TUNING, ACCELERATOR_TUNING, CpuKernelAttention(), PallasAttention())
    return min(page_size, *(min(b.q_blocks) for b in backends))
