"""Decides once per GPU kind and attention shape which tiles the Pallas kernel's prefill items run with, for the
engine's start-up (as `gpu_matmul_choice` does for the few-row matmul).

A prefill chunk's attention runs in `ragged_paged_attention`'s work items: `block_q` query tokens of one sequence
against `kv_block`-key blocks, with Triton's `num_warps`/`num_stages`. The defaults suit decodes and short chunks;
a long chunk's attention is compute-bound and wants bigger tiles, and which ones win depends on the GPU and the
head layout, so the candidates are timed on one prefill of the step's widest bucket with the model's own head
layout, alternately, and the fastest kept. Timings are cached per device kind and shape
(`~/.cache/jaxserve/gpu/<device kind>.attention.json`), so later starts only read them. Only the split-KV backend
(a GPU's default) takes them: its decodes run in their own kernel, so bigger prefill tiles cost decodes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.gpu.ragged_paged_attention import q_block_tokens, ragged_paged_attention
from jaxserve.kernels.gpu.split_kv_decode import SplitKvAttention
from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.platform.cache_file import read_json, write_json

log = logging.getLogger(__name__)
CACHE_DIR = Path("~/.cache/jaxserve/gpu")
# A program's query rows (bq tokens x the padded group): past 256 its accumulator and scores cannot stay in registers.
MAX_PROGRAM_ROWS = 256
REPEATS = 5


@dataclass(frozen=True)
class PrefillTiles:
    """One candidate: query tokens per work item, keys per inner block, Triton's warps and pipeline stages."""

    block_q: int
    kv_block: int
    num_warps: int
    num_stages: int

    @property
    def key(self) -> str:
        return f"q{self.block_q}_k{self.kv_block}_w{self.num_warps}_s{self.num_stages}"


# The backend's defaults first (they win ties), then wider query tiles, longer key blocks, more warps and stages:
# the shapes Triton's flash-attention tutorials settle on for Ampere and Hopper.
CANDIDATES = (
    PrefillTiles(16, 64, 4, 2),
    PrefillTiles(32, 64, 4, 2),
    PrefillTiles(32, 64, 8, 3),
    PrefillTiles(64, 64, 8, 3),
    PrefillTiles(32, 128, 8, 3),
    PrefillTiles(64, 128, 8, 2),
)


def fitting(candidates: Sequence[PrefillTiles], num_tokens: int, group: int, page_size: int) -> list[PrefillTiles]:
    """The candidates whose programs hold at most MAX_PROGRAM_ROWS query rows at this group size and whose key
    blocks hold whole pages."""
    g2 = 1 << max(0, group - 1).bit_length()
    return [c for c in candidates if q_block_tokens(num_tokens, group, c.block_q) * g2 <= MAX_PROGRAM_ROWS
            and c.kv_block >= page_size]


def one_prefill(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array, AttentionMetadata]:
    """A step of one `num_tokens`-token prompt with no prior context: queries, K and V pools, metadata."""
    pages = -(-num_tokens // page_size)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_heads, head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((pages + 1, page_size, num_kv_heads, head_dim)), dtype)
            for _ in range(2))
    meta = AttentionMetadata(
        slot_mapping=jnp.arange(page_size, page_size + num_tokens, dtype=jnp.int32),
        cu_q_lens=jnp.asarray([0, num_tokens], jnp.int32), kv_lens=jnp.asarray([num_tokens], jnp.int32),
        page_table=jnp.arange(1, pages + 1, dtype=jnp.int32)[None], num_seqs=jnp.asarray(1, jnp.int32),
        num_decodes=jnp.asarray(0, jnp.int32))
    return q, k, v, meta


def time_each(fns: Sequence[Callable[[], Any]], repeats: int = REPEATS) -> list[float]:
    """Median seconds of each of `fns`, after one call each (the compile), alternating so that all see the same
    state of the machine; infinity for one that fails to compile or run (tiles past the GPU's shared memory)."""
    times: list[list[float]] = [[] for _ in fns]
    live = []
    for f, ts in zip(fns, times, strict=True):
        try:
            jax.block_until_ready(f())
            live.append((f, ts))
        except Exception as e:  # noqa: BLE001 - Triton's compile errors have no common type
            log.info("prefill tiles failed to run, skipped: %s", str(e).splitlines()[0] if str(e) else type(e))
            ts.append(float("inf"))
    for _ in range(repeats):
        for f, ts in live:
            t = time.perf_counter()
            jax.block_until_ready(f())
            ts.append(time.perf_counter() - t)
    return [float(np.median(ts)) for ts in times]


def measure(candidates: Sequence[PrefillTiles], num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
            page_size: int, dtype: jnp.dtype, timer: Callable[..., list[float]] = time_each) -> dict[str, float]:
    """Seconds of one `num_tokens`-token prefill's attention per candidate."""
    q, k, v, meta = one_prefill(num_tokens, num_heads, num_kv_heads, head_dim, page_size, dtype)
    fns = []
    for c in candidates:
        f = jax.jit(lambda q, k, v, m, c=c: ragged_paged_attention(
            q, k, v, m, head_dim**-0.5, block_q=c.block_q, kv_block=c.kv_block, num_warps=c.num_warps,
            num_stages=c.num_stages))
        fns.append(lambda f=f: f(q, k, v, meta))
    return {c.key: t for c, t in zip(candidates, timer(fns), strict=True)}


def choose(attention: SplitKvAttention, *, num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
           page_size: int, dtype: jnp.dtype, device: Any, cache: Path | None = None,
           timer: Callable[..., list[float]] = time_each,
           candidates: Sequence[PrefillTiles] = CANDIDATES) -> SplitKvAttention:
    """`attention` with the prefill tiles measured fastest for a `num_tokens` prefill on this `device`'s kind
    (measured now unless cached), logged in one line; unchanged when no candidate fits."""
    fit = fitting(candidates, num_tokens, num_heads // num_kv_heads, page_size)
    if len(fit) < 2:
        return attention
    kind = str(getattr(device, "device_kind", "gpu")).replace("/", "_").replace(" ", "_")
    path = cache or CACHE_DIR.expanduser() / f"{kind}.attention.json"
    data = read_json(path)
    shape = f"t{num_tokens}_h{num_heads}_kv{num_kv_heads}_d{head_dim}_p{page_size}_{jnp.dtype(dtype).name}"
    entry = data.setdefault(shape, {})
    missing = [c for c in fit if c.key not in entry]
    t = time.perf_counter()
    if missing:
        entry.update(measure(missing, num_tokens, num_heads, num_kv_heads, head_dim, page_size, dtype, timer))
        write_json(path, data)
    best = min(fit, key=lambda c: entry[c.key])  # min keeps the first of equals: the defaults win ties
    how = f"measured in {time.perf_counter() - t:.1f} s" if missing else "cached"
    log.info("GPU prefill attention tiles %s for %s (%.3f ms; defaults %.3f ms; timings %s: %s)", best.key, shape,
             entry[best.key] * 1e3, entry[fit[0].key] * 1e3, how, path)
    return dataclasses.replace(attention, block_q=best.block_q, prefill_kv_block=best.kv_block,
                               prefill_num_warps=best.num_warps, prefill_num_stages=best.num_stages)
