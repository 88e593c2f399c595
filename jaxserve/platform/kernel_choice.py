"""Decides once per machine and model at which row counts jaxserve's CPU matmul kernel beats XLA's own dots, as a
`KernelPlan` for the engine's start-up.

For every row count the engine runs up to `cpu_matmul.MAX_ROWS` (its token buckets for the projections, its
sequence buckets for the LM head), the model's own matrices (every layer's, so that they come from memory as in a
step) are timed through the kernel and through XLA alternately; the kernel keeps a row count only where its
least time is the lower. Row counts an engine's overlapped loop runs beside its host work (`beside_host`) are
timed with a stand-in for that work between each call's dispatch and its wait: the kernel's helper threads and the
host then contend for the cores as in that loop. First, the one-row projections are timed with other part counts
than the kernel's default (`row_part_candidates`), and the plan keeps the fastest (`KernelPlan.row_parts`). The
timings are cached beside the kernel library (`<library>.plan.json`: keyed like it by the sources, flags, compiler,
jaxlib and CPU), per model shape and thread count, so later starts only read them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.core import progress
from jaxserve.kernels.cpu import library as cpu_kernels
from jaxserve.kernels.cpu import matmul as cpu_matmul
from jaxserve.kernels.cpu import matmul_int8 as cpu_matmul_int8
from jaxserve.kernels.cpu.kernel_plan import KernelPlan
from jaxserve.model.llama import linear
from jaxserve.model.moe import MoE, grouped_experts
from jaxserve.model.ops import MatmulRoute
from jaxserve.model.quantize import QuantizedWeight
from jaxserve.platform.cpu_contention import OthersCpu
from modelspec.moe_tiles import DECODE_TILE_MAX

logger = logging.getLogger(__name__)

NO_KERNEL = KernelPlan("", frozenset(), frozenset())  # a plan that gives every row count to XLA
# XLA's own dots as a CPU step runs them: Eigen for 2-16-row GEMMs (x transposed), quantized weights converted in
# step order (docs/tuning.md, docs/quantization.md).
CPU_XLA_ROUTE = MatmulRoute(transposed_rows=(2, 16), step_order_converts=True, moe_tiles_in_use=True)
# jaxserve's C++ matmuls wherever they take the shapes, XLA's CPU path elsewhere.
CPU_KERNEL_ROUTE = dataclasses.replace(CPU_XLA_ROUTE, cpu_kernel=True)
# How the timings were taken, in the cache's key: timings taken otherwise are measured again.
TIMING = "in sequence, best of 15, one row in its measured parts"
# Alternating rounds of the two paths per row count; each keeps its least time: a busy machine only adds time, and
# with 5 rounds' medians a busy minute gave bard's one-row projections to XLA, slower in a step (docs/tuning.md).
REPEATS = 15
# The stand-in for the overlapped loop's host work beside a step: Python work this long when it runs alone (a small
# model's host step, docs/tuning.md "The kernel plan").
HOST_WORK_S = 3e-4
BESIDE_HOST = " beside the host"  # the cache key's suffix of a row count timed with the stand-in
# Timings are kept beside the kernel library, in a file with this suffix. The test suite keeps its own (its two
# workers time plans while each other run: timings no engine outside it should trust; tests/conftest.py).
PLAN_SUFFIX = ".plan.json"
# The kernel's own part count for one row (matmul.cc's kRowParts), which each candidate is timed against.
DEFAULT_ROW_PARTS = 16


def row_part_candidates(threads: int) -> list[int]:
    """Part counts a one-row projection may take besides the default: one and two a thread."""
    return sorted({threads, 2 * threads} - {DEFAULT_ROW_PARTS})


def model_matrices(model: Any) -> tuple[list[jax.Array], jax.Array, bool]:
    """The [in, ...] weights a step's projections run over (every layer's, as `Attention` and `MLP` pass them to
    `linear`), the LM head's weight, and whether that is tied (the embedding, read as x @ w^T)."""
    weights = [w for layer in model.layers for w in layer.matmul_weights()]
    tied = model.lm_head is None
    return weights, model.embed[...] if tied else model.lm_head[...], tied


def moe_layers(model: Any) -> list[MoE]:
    """The model's routed-expert layers, whose tiles the grouped kernel may take."""
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]


def _threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def signature(weights: Sequence[jax.Array], head: jax.Array, tied: bool, experts: Sequence[MoE] = ()) -> str:
    """What the timings depend on beyond the library's key: the matrices' shapes and dtype, and the threads."""
    shapes = Counter("x".join(map(str, w.shape)) for w in weights)
    shapes.update(f"experts {'x'.join(map(str, m.experts_gate_up.shape))} top {m.top_k}" for m in experts)
    codes = sorted({str(w.dtype) for w in weights if isinstance(w, QuantizedWeight)})
    quantized = "".join(f" {c}" for c in codes)  # float plans keep their key
    return (f"{_threads()} threads {head.dtype}{quantized} " + " ".join(f"{s}*{n}" for s, n in sorted(shapes.items()))
            + f" head {'x'.join(map(str, head.shape))}{' tied' if tied else ''} {TIMING}")


def time_pair(kernel: Callable[..., Any], xla: Callable[..., Any], args: tuple,
              repeats: int = REPEATS) -> list[float]:
    """The least seconds of kernel(*args) and of xla(*args) over `repeats` rounds, after one call each (the
    compile), alternating so that both see the same states of the machine."""
    times: tuple[list[float], list[float]] = ([], [])
    for f in (kernel, xla):
        jax.block_until_ready(f(*args))
    for _ in range(repeats):
        for f, ts in zip((kernel, xla), times, strict=True):
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append(time.perf_counter() - t)
    return [float(min(ts)) for ts in times]


def _count_to(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def host_work(seconds: float = HOST_WORK_S) -> Callable[[], None]:
    """A fixed amount of Python work that takes about `seconds` on this machine alone: a fixed count, not a fixed
    time, so that threads competing for the cores stretch it as they stretch the host's real work."""
    t = time.perf_counter()
    _count_to(100_000)
    n = max(1, int(seconds / max((time.perf_counter() - t) / 100_000, 1e-9)))
    return lambda: _count_to(n) and None


def _beside(f: Callable[..., Any], work: Callable[[], None] | None) -> Callable[..., Any]:
    """`f` dispatched, then `work` on this thread while it runs (the overlapped loop's pattern); `f` alone if None."""
    if work is None:
        return f

    def with_host_work(*args: Any) -> Any:
        out = f(*args)
        work()
        return out
    return with_host_work


def _supports(x: jax.ShapeDtypeStruct, w: jax.Array | QuantizedWeight) -> bool:
    """Whether `linear` would give x @ w to a kernel: the int8 one for quantized weights, else the float one."""
    return cpu_matmul_int8.supports(x, w.q) if isinstance(w, QuantizedWeight) else cpu_matmul.supports(x, w)


def _in_sequence(matmul: Callable[[jax.Array, Any], jax.Array]) -> Callable[..., list[jax.Array]]:
    """`matmul(xs[w's input width], w)` for every w, each waiting for the one before (its input takes a zero-scaled
    element of the last output), as a step's matmuls run: independent, XLA's CPU runtime would run several side by
    side, which no step does and which flattered XLA's dots at 4-8 rows (docs/tuning.md, "The kernel plan")."""
    def run(xs: dict[int, jax.Array], ws: Sequence[Any]) -> list[jax.Array]:
        outs, after = [], None
        for w in ws:
            x = xs[_input_width(w)]
            y = matmul(x if after is None else x + after.astype(x.dtype), w)
            after = y[0, 0] * 0.0  # a float product by zero: XLA does not fold it away
            outs.append(y)
        return outs
    return run


def _input_width(w: Any) -> int:
    return w.q.shape[0] if isinstance(w, QuantizedWeight) else w.shape[0]


def _measure_matmuls(weights: list[jax.Array], rows: Sequence[int], repeats: int,
                     dtype: jnp.dtype = jnp.float32, row_parts: int = 0,
                     work: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """[kernel, XLA] seconds per row count for all of `weights` one after another, each as `linear` runs it (one
    row in `row_parts` parts, 0: the kernel's default), each call `_beside` the host `work` when given."""
    # XLA's side as the engine runs it where the plan declines the kernel
    every = dataclasses.replace(NO_KERNEL, matmul_rows=frozenset(rows), row_parts=row_parts)
    kernel, xla = (jax.jit(_in_sequence(lambda x, w, r=r: linear(x, w, r)))
                   for r in (dataclasses.replace(CPU_KERNEL_ROUTE, plan=every),
                             dataclasses.replace(CPU_KERNEL_ROUTE, plan=NO_KERNEL)))
    inputs = {_input_width(w) for w in weights}
    return {str(r): time_pair(_beside(kernel, work), _beside(xla, work),
                              ({n: jnp.ones((r, n), dtype) for n in inputs}, weights), repeats) for r in rows}


def _measure_row_parts(weights: list[jax.Array], candidates: Sequence[int], repeats: int,
                       dtype: jnp.dtype = jnp.float32) -> dict[str, list[float]]:
    """[default parts, candidate] seconds per candidate part count, all of `weights` at one row, one after
    another through the kernel."""
    def kernel(parts: int) -> Callable[..., list[jax.Array]]:
        return jax.jit(_in_sequence(lambda x, w: cpu_matmul.cpu_matmul(x, w, parts)))

    default = kernel(DEFAULT_ROW_PARTS)
    xs = {n: jnp.ones((1, n), dtype) for n in {_input_width(w) for w in weights}}
    return {str(c): time_pair(default, kernel(c), (xs, weights), repeats) for c in candidates}


def _fewest_time_parts(timings: dict[str, list[float]]) -> int:
    """The candidate whose time against its paired default was the least ratio below 1, else 0 (the default)."""
    ratios = {int(c): t[1] / t[0] for c, t in timings.items() if t[0] > 0}
    best = min(ratios, key=ratios.get, default=0)
    return best if best and ratios[best] < 1.0 else 0


def _measure_head(model: Any, rows: Sequence[int], repeats: int,
                  work: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """[kernel, XLA] seconds per row count of the model's LM head, as `compute_logits` runs it (`_beside` the host
    `work` when given)."""
    graphdef, state = nnx.split(model)
    kernel, xla = (jax.jit(lambda s, h, r=r: nnx.merge(graphdef, s).compute_logits(h, r))
                   for r in (CPU_KERNEL_ROUTE, CPU_XLA_ROUTE))
    hidden, dtype = model.embed.shape[1], model.embed[...].dtype
    return {str(r): time_pair(_beside(kernel, work), _beside(xla, work), (state, jnp.ones((r, hidden), dtype)),
                              repeats) for r in rows}


def _measure_moe(layers: list[MoE], rows: Sequence[int], repeats: int,
                 dtype: jnp.dtype = jnp.float32) -> dict[str, list[float]]:
    """[kernel, XLA] seconds per step size of every MoE layer's expert tiles, as `MoE` runs them, for a seeded
    random routing (each token to top_k distinct experts)."""
    if not rows:
        return {}
    mm = lambda a, w: linear(a, w.reshape(w.shape[0], -1), CPU_XLA_ROUTE)  # noqa: E731
    experts = [(m.experts_gate_up[...], m.experts_down[...]) for m in layers]
    kernel, xla = (jax.jit(lambda x, ids, ws, ex, g=g: [grouped_experts(x, ids, ws, gu, dn, mm, g) for gu, dn in ex])
                   for g in (cpu_matmul.cpu_grouped_matmul, None))
    e, k, hidden = layers[0].experts_gate_up.shape[0], layers[0].top_k, layers[0].experts_gate_up.shape[1]
    timings = {}
    for r in rows:
        ids = jnp.asarray(np.argsort(np.random.default_rng(r).random((r, e)), axis=1)[:, :k], jnp.int32)
        args = (jnp.ones((r, hidden), dtype), ids, jnp.full((r, k), 1.0 / k, jnp.float32), experts)
        timings[str(r)] = time_pair(kernel, xla, args, repeats)
    return timings


def _measure_int8_threads(weights: list[Any], rows: Sequence[int], repeats: int,
                          dtype: jnp.dtype = jnp.float32) -> dict[str, list[float]]:
    """[one thread, all threads] seconds per row count of every int8 matrix through the int8 kernel, one after
    another."""
    one, every = (jax.jit(_in_sequence(lambda x, w, t=t: cpu_matmul_int8.cpu_matmul_int8(x, w.q, w.scale, t)))
                  for t in (1, 0))
    inputs = {_input_width(w) for w in weights}
    return {str(r): time_pair(one, every, ({n: jnp.ones((r, n), dtype) for n in inputs}, weights), repeats)
            for r in rows}


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: Path, data: dict) -> None:
    """Atomically: engines starting side by side each publish a whole file (the last one's timings win)."""
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def choose(model: Any, token_buckets: Sequence[int], seq_buckets: Sequence[int], *, cache: Path | None = None,
           repeats: int = REPEATS, beside_host: Sequence[int] = ()) -> KernelPlan | None:
    """The plan for `model` on this machine: the row counts among the buckets the kernel can take where it was
    measured faster than XLA (measured now for any not in `cache`, default beside the kernel library), logged in
    one line; the row counts in `beside_host` (an overlapped loop's) timed with the host's work beside them. None
    where the kernels are not available."""
    if not cpu_kernels.available():
        return None
    weights, head, tied = model_matrices(model)
    supports_head = cpu_matmul.supports_nt if tied else _supports
    dtype = model.embed[...].dtype  # the activations' (an int8 head's codes are not)
    matmul_rows = [r for r in sorted(set(token_buckets)) if any(
        _supports(jax.ShapeDtypeStruct((r, w.shape[0]), dtype), w) for w in weights)]
    head_rows = [r for r in sorted(set(seq_buckets))
                 if supports_head(jax.ShapeDtypeStruct((r, model.embed.shape[1]), dtype), head)]
    experts = moe_layers(model)
    moe_rows = [r for r in sorted(set(token_buckets)) if experts and r <= DECODE_TILE_MAX and all(
        cpu_matmul.supports_grouped(jax.ShapeDtypeStruct((r, m.experts_gate_up.shape[1]), dtype), w)
        for m in experts for w in (m.experts_gate_up[...], m.experts_down[...]))]
    # int8 matrices the kernel takes (the head's too), and the row counts at which one thread may beat all of them
    codes = [w for w in [*weights, head] if isinstance(w, QuantizedWeight)
             and _supports(jax.ShapeDtypeStruct((1, w.shape[0]), dtype), w)]
    int8_rows = sorted(set(matmul_rows) | set(head_rows)) if codes and _threads() > 1 else []
    cache = cache or cpu_kernels.library_path().with_suffix(PLAN_SUFFIX)
    data = _read(cache)
    entry = data.setdefault(signature(weights, head, tied, experts), {"matmul": {}, "head": {}})
    entry.setdefault("moe", {})
    entry.setdefault("int8_threads", {})
    entry.setdefault("row_parts", {})
    t = time.perf_counter()
    others = OthersCpu()  # what other processes take while these timings run
    floats = [w for w in weights if not isinstance(w, QuantizedWeight)]  # the float kernel's, cut in parts
    parts_to_time = [c for c in row_part_candidates(_threads()) if str(c) not in entry["row_parts"]] \
        if 1 in matmul_rows and floats else []
    if parts_to_time:  # first: the one-row timings against XLA below take the part count chosen here
        logger.info("timing the C++ kernels: one row in %s parts against %d", parts_to_time, DEFAULT_ROW_PARTS)
        entry["row_parts"].update(_measure_row_parts(floats, parts_to_time, repeats, dtype))
    row_parts = _fewest_time_parts(entry["row_parts"])

    def key(r: int) -> str:
        return f"{r}{BESIDE_HOST}" if r in beside_host else str(r)

    missing = [r for r in matmul_rows if key(r) not in entry["matmul"]]
    missing_head = [r for r in head_rows if key(r) not in entry["head"]]
    missing_moe = [r for r in moe_rows if str(r) not in entry["moe"]]
    missing_int8 = [r for r in int8_rows if str(r) not in entry["int8_threads"]]
    measured = bool(parts_to_time or missing or missing_head or missing_moe or missing_int8)
    if measured:
        alone = [[r for r in rows if r not in beside_host] for rows in (missing, missing_head)]
        beside = [[r for r in rows if r in beside_host] for rows in (missing, missing_head)]
        parts = [(name, rows) for name, rows in (
            ("projections", alone[0]), ("LM head", alone[1]), (f"projections{BESIDE_HOST}", beside[0]),
            (f"LM head{BESIDE_HOST}", beside[1]), ("MoE experts", missing_moe), ("int8 threads", missing_int8))
            if rows]
        work = host_work() if beside[0] or beside[1] else None
        task = "timing the C++ kernels against XLA (once per model and machine)"
        for i, (name, rows) in enumerate(parts):
            logger.info("%s: %s at %d row counts (%d of %d)", task, name, len(rows), i + 1, len(parts),
                        extra=progress.step(task, i, len(parts)))
            host = work if name.endswith(BESIDE_HOST) else None
            if name.startswith("projections"):
                got = _measure_matmuls(weights, rows, repeats, dtype, row_parts, host)
                entry["matmul"].update({key(int(r)): t for r, t in got.items()})
            elif name.startswith("LM head"):
                got = _measure_head(model, rows, repeats, host)
                entry["head"].update({key(int(r)): t for r, t in got.items()})
            elif name == "MoE experts":
                entry["moe"].update(_measure_moe(experts, rows, repeats, dtype))
            else:
                entry["int8_threads"].update(_measure_int8_threads(codes, rows, repeats, dtype))
    if measured and others.busy():  # such timings would choose every later start's plan: they serve this one only
        logger.warning("the C++ kernels were timed while other processes used %.2f cores: the plan serves this "
                       "start and is not cached (%s)", others.cores(), cache)
    elif measured:
        _write(cache, data)

    def faster(timings: dict[str, list[float]], rows: list[int], keyed: Callable[[int], str] = str) -> frozenset[int]:
        return frozenset(r for r in rows if timings[keyed(r)][0] < timings[keyed(r)][1])

    plan = KernelPlan(cpu_kernels.isa() or "", faster(entry["matmul"], matmul_rows, key),
                      faster(entry["head"], head_rows, key),
                      faster(entry["moe"], moe_rows), faster(entry["int8_threads"], int8_rows), row_parts)
    how = f"measured in {time.perf_counter() - t:.1f} s" if measured else "cached"
    logger.info("%s (timings %s: %s)", plan.describe(), how, cache)
    return plan
