"""The runner's sampler: the LM head over the step's hidden rows, then `sampling.sample_tokens`, in static tiers.

What a step's rows need is known on the host when the batch is built (`SamplingArrays`, `Processing`), so the
host picks one of a few compiled tiers, each a superset of the one before: "greedy" (argmax only), "greedy_top"
(+ the top logprobs), "sample" (a seeded draw at each row's temperature, + top logprobs), "cut" (+ the top-k /
top-p / min-p cut), "processed" (+ logits processing: penalties, a bias, bans, a grammar's mask). The top
logprobs cost little beside a draw (docs/tuning.md), so only greedy steps skip them. Each tier compiles per
sampling bucket at warm-up and counts in `compile_count`; the device never decides a branch: no conditional, and
no predicate copied to the host.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core import progress
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.runner.compiles import compiled_variants
from jaxserve.runner.logits_processing import Processing, process_logits
from jaxserve.runner.sampling import sample_tokens

NUM_SAMPLING_ROWS = 6  # temperature, top_k, top_p, min_p, seed, step
NUM_PROCESSING_ARRAYS = 6  # Processing.arrays()

logger = logging.getLogger(__name__)


@dataclass
class SamplingArrays:
    """Per-row sampling parameters for one padded batch (host numpy, S rows)."""

    temperature: np.ndarray  # f32; 0 = greedy
    top_k: np.ndarray  # i32; <= 0 disables
    top_p: np.ndarray  # f32; 1 disables
    min_p: np.ndarray  # f32; 0 disables
    seed: np.ndarray  # u32
    step: np.ndarray  # i32, index of the token being drawn
    want_logprobs: bool

    @classmethod
    def build(cls, rows: list[tuple[SamplingParams, int, int]], size: int) -> SamplingArrays:
        """From `(params, seed, step)` per real row, padded to `size` greedy rows."""
        a = cls(temperature=np.zeros(size, np.float32), top_k=np.zeros(size, np.int32),
                top_p=np.ones(size, np.float32), min_p=np.zeros(size, np.float32),
                seed=np.zeros(size, np.uint32), step=np.zeros(size, np.int32), want_logprobs=False)
        for i, (p, seed, step) in enumerate(rows):
            a.temperature[i] = p.temperature
            a.top_k[i] = p.top_k
            a.top_p[i] = p.top_p
            a.min_p[i] = p.min_p
            a.seed[i] = seed & 0xFFFFFFFF
            a.step[i] = step
            a.want_logprobs |= p.logprobs is not None
        return a

    @property
    def draw(self) -> str:
        """"greedy" when no row samples, "cut" when a sampling row filters (top-k, top-p, min-p), else "sample"."""
        sampling = self.temperature > 0
        if not sampling.any():
            return "greedy"
        cuts = sampling & ((self.top_k > 0) | (self.top_p < 1.0) | (self.min_p > 0))
        return "cut" if cuts.any() else "sample"

    def rows(self) -> tuple[np.ndarray, ...]:
        """The six per-row arrays, in the jitted functions' order."""
        return self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.step


# tier -> (draw, want_top, processed) of `sampling.sample_tokens`
TIERS = {"greedy": ("greedy", False, False), "greedy_top": ("greedy", True, False), "sample": ("sample", True, False),
         "cut": ("cut", True, False), "processed": ("cut", True, True)}


def tier_for(sampling: SamplingArrays, processed: bool = False) -> str:
    """The cheapest tier that serves every row of a step (decided on the host)."""
    if processed:
        return "processed"
    draw = sampling.draw
    if draw != "greedy":
        return draw
    return "greedy_top" if sampling.want_logprobs else "greedy"


class Sampler:
    """A `ModelRunner`'s jitted sampler in every tier (`TIERS`), each compiled per sampling bucket (`warmup`)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.vocab_size = int(runner.model().embed[...].shape[0])
        self.history_len = runner.pages_per_seq * runner.page_size  # the penalties' token history
        self._fns: dict[str, Any] = {}

    def _impl(self, tier: str, param_leaves, hidden_rows, temperature, top_k, top_p, min_p, seed, step,
              *processing):
        r = self.runner
        draw, want_top, processed = TIERS[tier]
        logits = r.model(param_leaves).compute_logits(hidden_rows[: temperature.shape[0]], r.ops.matmul)
        tokens, *rest = sample_tokens(logits, temperature, top_k, top_p, min_p, seed, step, draw=draw,
                                      want_top=want_top, cut=r.policy.sampler_cut,
                                      processed=process_logits(logits, *processing) if processed else None)
        # Padded to max_sampled rows: the next forward may read them on the device (placeholders), one shape.
        return (jnp.zeros(r.max_sampled, jnp.int32).at[: tokens.shape[0]].set(tokens), *rest)

    def _fn(self, tier: str) -> Any:
        if tier not in self._fns:
            _, want_top, processed = TIERS[tier]
            inputs = 1 + NUM_SAMPLING_ROWS + (NUM_PROCESSING_ARRAYS if processed else 0)
            self._fns[tier] = self.runner.jit_step(functools.partial(self._impl, tier), num_inputs=inputs,
                                                   num_outputs=4 if want_top else 2, pool=False)
        return self._fns[tier]

    def _call(self, hidden_rows: jax.Array, sampling: SamplingArrays, requests: list | None) -> tuple[Any, tuple]:
        """The tier a step needs and its arguments (the host's decision: processing is built only when needed)."""
        proc = Processing.build(requests or [], sampling.temperature.shape[0], self.vocab_size, self.history_len)
        extra = proc.arrays() if proc is not None else ()
        r = self.runner
        return self._fn(tier_for(sampling, proc is not None)), (r.param_leaves, hidden_rows,
                                                                 *r.put((*sampling.rows(), *extra)))

    def __call__(self, hidden_rows: jax.Array, sampling: SamplingArrays, requests: list | None = None) -> tuple:
        """Draw for a step whose logits rows are `hidden_rows`; `requests` (scheduler Requests, None entries for
        padding or followers) tell whether logits processing is needed. Returns device arrays: tokens
        [max_sampled], their logprobs [S] and, but in the greedy tier, the top ids and logprobs [S, K]."""
        fn, args = self._call(hidden_rows, sampling, requests)
        return fn(*args)

    def lower(self, hidden_rows: jax.Array, sampling: SamplingArrays, requests: list | None = None) -> Any:
        """The tier `__call__` would run, lowered for these arguments (to read its program; nothing runs)."""
        fn, args = self._call(hidden_rows, sampling, requests)
        return fn.lower(*args)

    def warmup(self, hidden_rows: jax.Array) -> None:
        """Compile every tier for every sampling bucket (on rows of an empty forward)."""
        r = self.runner
        task = "compiling the sampler, one per batch-size bucket"
        n = len(r.seq_buckets)
        for i, size in enumerate(r.seq_buckets):
            logger.info("%s: %d rows (%d of %d)", task, size, i + 1, n, extra=progress.step(task, i, n))
            rows = SamplingArrays.build([], size).rows()
            neutral = Processing.neutral(size, self.vocab_size, self.history_len).arrays()
            for tier, (_, _, processed) in TIERS.items():
                args = r.put((*rows, *(neutral if processed else ())))
                jax.block_until_ready(self._fn(tier)(r.param_leaves, hidden_rows, *args))
        logger.info("%s: done", task, extra=progress.step(task, n, n))

    def compile_count(self) -> int:
        """Compiled tiers so far, over every sampling bucket."""
        return compiled_variants(self._fns.values())
