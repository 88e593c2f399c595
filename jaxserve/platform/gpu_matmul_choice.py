"""Decides once per GPU kind and model at which row counts the Pallas few-row matmul beats XLA's dot, for the
engine's start-up (the GPU side of what `kernel_choice` does for a CPU).

For every token bucket of at most `matvec.MAX_ROWS` rows, the model's own projection weights (every layer's, in
their stored dtype: float, or int8/fp8 codes) are timed through the kernel and through XLA's dot, alternately; the
kernel keeps a row count only where its median is the lower. Timings are cached per device kind and model shape
(`~/.cache/jaxserve/gpu/<device kind>.plan.json`), so later starts only read them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.kernels.gpu.matvec import MAX_ROWS, matvec_supports
from jaxserve.model.layers import gpu_matvec, linear
from jaxserve.model.quantize import QuantizedWeight
from jaxserve.platform.cache_file import read_json, write_json
from jaxserve.platform.kernel_choice import model_matrices, signature, time_pair

log = logging.getLogger(__name__)
CACHE_DIR = Path("~/.cache/jaxserve/gpu")


def _supported(rows: int, weights: Sequence[Any], dtype: jnp.dtype, capability: float | None) -> bool:
    def ok(w: Any) -> bool:
        q = w.q if isinstance(w, QuantizedWeight) else w
        return matvec_supports(rows, q.shape[0], q.size // q.shape[0], dtype, q.dtype, capability)

    return all(ok(w) for w in weights)


def measure(weights: list[Any], rows: Sequence[int], dtype: jnp.dtype, repeats: int = 5,
            timer: Callable[..., list[float]] = time_pair) -> dict[str, list[float]]:
    """[kernel, XLA] seconds per row count for all of `weights`."""
    kernel = jax.jit(lambda xs, ws: [gpu_matvec(xs[_k(w)], w) for w in ws])
    xla = jax.jit(lambda xs, ws: [linear(xs[_k(w)], w) for w in ws])
    inputs = {_k(w) for w in weights}
    return {str(r): timer(kernel, xla, ({n: jnp.ones((r, n), dtype) for n in inputs}, weights), repeats)
            for r in rows}


def _k(w: Any) -> int:
    return (w.q if isinstance(w, QuantizedWeight) else w).shape[0]


def choose(model: Any, token_buckets: Sequence[int], device: Any, *, cache: Path | None = None,
           timer: Callable[..., list[float]] = time_pair) -> frozenset[int]:
    """The row counts among `token_buckets` (<= MAX_ROWS) where the kernel was measured faster on this `device`'s
    kind (measured now for any not cached), logged in one line; empty where the kernel cannot take the weights."""
    weights, head, tied = model_matrices(model)
    dtype = model.embed[...].dtype
    capability = _capability(device)
    rows = [r for r in sorted(set(token_buckets)) if r <= MAX_ROWS and _supported(r, weights, dtype, capability)]
    if not rows:
        return frozenset()
    kind = str(getattr(device, "device_kind", "gpu")).replace("/", "_").replace(" ", "_")
    path = cache or CACHE_DIR.expanduser() / f"{kind}.plan.json"
    data = read_json(path)
    entry = data.setdefault(signature(weights, head, tied), {})
    missing = [r for r in rows if str(r) not in entry]
    t = time.perf_counter()
    if missing:
        entry.update(measure(weights, missing, dtype, timer=timer))
        write_json(path, data)
    chosen = frozenset(r for r in rows if entry[str(r)][0] < entry[str(r)][1])
    how = f"measured in {time.perf_counter() - t:.1f} s" if missing else "cached"
    log.info("GPU few-row matmul at %s rows of %s (XLA's dot elsewhere; timings %s: %s)",
             ", ".join(map(str, sorted(chosen))) or "no", ", ".join(map(str, rows)), how, path)
    return chosen


def _capability(device: Any) -> float | None:
    try:
        return float(getattr(device, "compute_capability", None))
    except (TypeError, ValueError):
        return None


def fp8_tensor_cores(device: Any) -> bool:
    """Whether the device multiplies fp8 natively (compute capability 8.9 and up: Ada, Hopper, Blackwell)."""
    capability = _capability(device)
    return capability is not None and capability >= 8.9
