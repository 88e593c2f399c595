"""Step times the serving models are built from, cached for one (spec, hardware, config, workload).

A step carries `batch` decodes at the workload's mean decode context and prefill chunks; it runs at the
runtime's padded token count (`ServingConfig.token_buckets`). `planner.serving` (Poisson loads and spread-out
closed loops) and `planner.closed_loop` (clients in waves) price their steps here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from modelspec.memory import MemoryPlan
from modelspec.spec import ModelSpec
from planner.hardware import Hardware
from planner.step_model import (
    StepShape,
    decode_shape,
    pad_tokens,
    prefill_chunk_tokens,
    prefill_shape,
    step_time_shape,
)
from planner.workload import ServingConfig, Workload


class StepCosts:
    """Cached step times for one (spec, hardware, config, workload); the closed form's building blocks."""

    def __init__(self, spec: ModelSpec, hw: Hardware, cfg: ServingConfig, wl: Workload, mem: MemoryPlan):
        self.spec, self.hw, self.cfg, self.wl, self.mem = spec, hw, cfg, wl, mem
        self.slots = max(1, min(cfg.max_num_seqs, mem.max_concurrency(wl.input_len + wl.output_len)))
        self.ctx = wl.input_len + wl.output_len / 2  # mean context of a decoding sequence
        self.prefix = wl.input_len - wl.computed_input
        self._many = lru_cache(maxsize=8192)(self._many_uncached)

    def _t(self, batch: int, q: int, computed: float) -> float:
        """A step of `batch` decodes and one prefill chunk of `q` tokens after `computed` (none when q = 0)."""
        return self._many(int(batch), ((int(q), float(computed)),) if q > 0 else ())

    def t_dec(self, b: float) -> float:
        """Decode-only step with b sequences (linear interpolation between integers)."""
        lo = int(b)
        t0 = self._t(max(lo, 1), 0, 0)
        return t0 + (b - lo) * (self._t(lo + 1, 0, 0) - t0) if lo >= 1 else self._t(1, 0, 0)

    def budget(self, b: float) -> int:
        return max(self.cfg.page_size, int(self.cfg.chunk_size - b))

    def prefill(self, b: float, n_tokens: float) -> tuple[float, int, list[float]]:
        """Marginal time Delta of prefilling n_tokens beside b decodes, the steps it takes, per-chunk Deltas."""
        bi, c = int(round(b)), self.budget(b)
        n_tokens = int(round(n_tokens))
        base = self._t(bi, 0, 0) if bi else 0.0
        p0, page = int(self.prefix), self.cfg.page_size
        # Chunks end on page boundaries, as the runtime cuts them; after the first, each is `c` rounded down to
        # whole pages (when a page fits in the budget).
        first = prefill_chunk_tokens(p0, n_tokens, c, page)
        steady = c // page * page if c >= page else c
        full, rem = divmod(n_tokens - first, steady)
        if full > 8:  # a full chunk's Delta is affine in the tokens before it: sum the series, keep a sample
            start = p0 + first
            d_first = self._t(bi, first, p0) - base
            d0 = self._t(bi, steady, start) - base
            slope = (self._t(bi, steady, start + steady) - base - d0) / steady
            deltas = [d_first] + [d0 + slope * j * steady for j in np.linspace(0, full - 1, 16).round().astype(int)]
            total = d_first + full * d0 + slope * steady * full * (full - 1) / 2
            if rem:
                last = self._t(bi, rem, start + full * steady) - base
                deltas.append(last)
                total += last
            return total, 1 + full + (1 if rem else 0), deltas
        deltas, done = [], 0
        while done < n_tokens:
            q = prefill_chunk_tokens(p0 + done, n_tokens - done, c, page)
            deltas.append(self._t(bi, q, p0 + done) - base)
            done += q
        return sum(deltas), len(deltas), deltas

    def input_points(self) -> np.ndarray:
        i = self.wl.computed_input
        s = self.wl.spread
        return np.array([i]) if s == 0 else np.linspace(i * (1 - s), i * (1 + s), 5)

    def step_s(self, decodes: int, chunks: Sequence[tuple[int, float]] = ()) -> float:
        """A step of `decodes` decodes and prefill `chunks` (tokens, tokens already computed before them)."""
        return self._many(int(decodes), tuple((int(q), float(c)) for q, c in chunks if q > 0))

    def _many_uncached(self, decodes: int, chunks: tuple[tuple[int, float], ...]) -> float:
        shape = decode_shape(decodes, self.ctx) if decodes else StepShape()
        for q, c in chunks:
            shape = shape + prefill_shape(q, c)
        return step_time_shape(self.spec, self.hw, shape, tp=self.cfg.tp, dtype=self.cfg.dtype,
                               kv_dtype=self.cfg.kv_dtype,
                               padded_tokens=pad_tokens(shape.num_tokens, self.cfg.token_buckets),
                               steps_per_dispatch=self.cfg.num_scheduler_steps,
                               overlapped=self.cfg.async_scheduling).total_s
