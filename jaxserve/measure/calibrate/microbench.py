"""Microbenchmarks of the local device: streaming bandwidth, GEMM peak and rates per row count, weight streams;
and the `Hardware` they describe."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.llama import linear
from jaxserve.model.ops import XLA_MATMULS, MatmulRoute
from jaxserve.model.quantize import QuantizedWeight
from jaxserve.platform.devices import DeviceFacts
from planner.hardware import CATALOG, GIGA, Hardware


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of `repeats` runs of `fn` (after one that compiles), in seconds."""
    jax.block_until_ready(fn())  # compile
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Streaming read bandwidth (bytes/s): a jitted sum over a float32 array of `nbytes`."""
    x = jnp.ones(nbytes // 4, jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    return nbytes / best_time(lambda: f(x), repeats)


def measure_weight_read(nbytes: int, repeats: int = 5) -> float | None:
    """Bytes/s of one row through jaxserve's CPU matmul kernel over one float32 matrix of `nbytes` (4096 columns):
    a decode's weight read in its best case, one call of long sequential rows on every intra-op thread. None
    where the kernels are not built. On a 2-core EPYC the streaming sum (`measure_bandwidth`) read well below it
    (docs/tuning.md), so a decode floor takes the higher of the two."""
    from jaxserve.kernels.cpu import library as cpu_kernels
    from jaxserve.kernels.cpu import matmul as cpu_matmul

    if not cpu_kernels.available():
        return None
    w = jnp.full((nbytes // 4 // 4096, 4096), 1e-3, jnp.float32)
    x = jnp.ones((1, w.shape[0]), jnp.float32)
    f = jax.jit(cpu_matmul.cpu_matmul)
    return w.size * 4 / best_time(lambda: f(x, w), repeats)


def measure_matmul(n: int, dtype: Any, repeats: int = 3) -> float:
    """Dense square-GEMM throughput (FLOP/s) in `dtype`."""
    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / best_time(lambda: f(a, b), repeats)


def measure_gemm_rows(rows: tuple[int, ...], k: int, n: int, dtype: Any, repeats: int = 3,
                      route: MatmulRoute = XLA_MATMULS, weight: Any = None) -> list[dict[str, float]]:
    """Time of x[M, k] @ W[k, n] per M (the model's fused gate/up shape) as the model runs it (`linear` by the
    engine's matmul `route`): achieved FLOP/s and bytes/s. `weight`: that matrix itself (a quantized engine's
    codes), else ones in `dtype`."""
    w = jnp.ones((k, n), dtype) if weight is None else weight
    f = jax.jit(lambda x, w: linear(x, w, route))
    out = []
    for m in rows:
        x = jnp.ones((m, k), dtype)
        t = best_time(lambda x=x: f(x, w), repeats)
        nbytes = k * n * np.dtype(w.dtype).itemsize + (m * k + m * n) * np.dtype(dtype).itemsize
        out.append({"rows": m, "seconds": t, "gflops": 2 * m * k * n / t / GIGA, "gbps": nbytes / t / GIGA})
    return out


def measure_weight_streams(weights: list[Any], rows: tuple[int, ...] = (1, 2), repeats: int = 50,
                           route: MatmulRoute = XLA_MATMULS, dtype: Any = None) -> dict[int, float]:
    """Weight bytes/s of each `rows` count of tokens through `weights` ([in, ...] arrays, together more than a
    cache holds), as the model runs them (`linear`, by the engine's matmul `route`): a
    decode's weight streaming. The row counts alternate and each keeps its median, so their ratio compares the
    two kernels in the same state of the machine. Fifty repeats keep that ratio steady where fewer let it wander
    (docs/tuning.md). `dtype`: the activations' (default the weights'; quantized weights' codes are not), and the
    bytes counted are the weights' own (a quantized weight's codes)."""
    f = jax.jit(lambda x, ws: sum(linear(x, w, route).sum() for w in ws))
    k = weights[0].shape[0]
    xs = {r: jnp.ones((r, k), dtype or weights[0].dtype) for r in rows}
    times: dict[int, list[float]] = {r: [] for r in rows}
    for r in rows:
        jax.block_until_ready(f(xs[r], weights))  # compile
    for _ in range(repeats):
        for r in rows:
            t0 = time.perf_counter()
            jax.block_until_ready(f(xs[r], weights))
            times[r].append(time.perf_counter() - t0)
    nbytes = sum(w.size * w.dtype.itemsize for w in weights)
    return {r: nbytes / float(np.median(times[r])) for r in rows}


def engine_mlp_weights(engine) -> list[Any]:
    """The engine's own fused gate/up weights ([hidden, 2, intermediate], one per layer; `QuantizedWeight`s in a
    quantized engine), or fresh arrays of that shape when the model has none: the rate is measured on the memory a
    decode step reads. On one VM the one-row rate jumped in a third of calibrations, own weights or fresh, while the
    engine's one-request TPOT did not; the cause is not known (docs/tuning.md)."""
    spec = engine.spec
    shape = (spec.hidden_size, 2, spec.intermediate_size)
    is_quantized = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    own = [w for w in jax.tree.leaves(engine.runner.params, is_leaf=is_quantized)
           if tuple(w.shape) == shape and (is_quantized(w) or w.dtype == engine.dtype)]
    if len(own) == spec.num_layers:
        return own
    return [jnp.full(shape, 1e-3 * (i + 1), engine.dtype) for i in range(spec.num_layers)]


def local_hardware(facts: DeviceFacts, memory_bw: float, peak: float, dtype: str,
                   weight_dtype: str | None = None) -> tuple[Hardware, str]:
    """A `Hardware` for the local device (`facts`: as the engine's policy read them) with measured peak (`dtype`'s
    GEMM) and bandwidth; links from the catalog if known. `weight_dtype` (int8, fp8 weights computed in `dtype`) gets
    the same peak."""
    platform, kind = facts.platform, facts.kind
    base = CATALOG["cpu"]
    for name, hw in CATALOG.items():
        if hw is not base and name.split("-")[0] in kind.lower().replace(" ", ""):
            base = hw
    memory = facts.memory_bytes or base.memory_bytes
    peaks = {dtype: peak}
    if dtype in ("bf16", "fp16"):
        peaks = {"bf16": peak, "fp16": peak}
    peaks[weight_dtype or dtype] = peak
    sources = {"compute": f"measured by jaxserve calibrate: {dtype} square GEMM on {kind}",
               "memory": f"measured by jaxserve calibrate: jitted streaming sum on {kind}; capacity from the device",
               "intra_node": f"from catalog entry {base.name!r}", "allreduce_latency": f"from catalog {base.name!r}",
               "inter_node": f"from catalog {base.name!r}"}
    hw = Hardware(name=f"calibrated-{platform}", peak_flops=peaks, memory_bytes=memory, memory_bw=memory_bw,
                  intra_node_bw=base.intra_node_bw, allreduce_latency_s=base.allreduce_latency_s,
                  inter_node_bw=base.inter_node_bw, devices_per_node=max(1, jax.local_device_count()),
                  sources=sources, coefficients=base.coefficients)
    return hw, f"{platform}: {kind} x{jax.local_device_count()}"
