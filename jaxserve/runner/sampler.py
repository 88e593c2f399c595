"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, with a per-request seed.

Each row draws one uniform number from `fold_in(key(seed), step)`, where `step` is the index of the token
being generated, and inverts the filtered distribution's CDF in vocabulary order. A request's samples
therefore depend only on its own logits, seed and position, never on what else shares the batch. The cut that
top-k, top-p and min-p need is computed only when some row asks for them (`lax.cond`): on a GPU by sorting
the vocabulary, on a CPU (where XLA's sort of a vocabulary's logits is slow; docs/tuning.md) by a 32-pass
bitwise search over the values' order keys. An all-greedy batch skips the random draw entirely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.runner.logits_processing import Processing, process_logits

NUM_TOP_LOGPROBS = 20


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


def _filter_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Per-row smallest kept logit after top-k, then top-p, then min-p: one descending sort per row."""
    vocab = scaled.shape[-1]
    srt = -jnp.sort(-scaled, axis=-1)
    e = jnp.exp(srt - srt[:, :1])  # probabilities relative to the most likely token
    cum = jnp.cumsum(e, axis=-1)
    n_k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    mass_k = jnp.take_along_axis(cum, (n_k - 1)[:, None], axis=-1)
    n_p = jnp.sum((cum - e) < top_p[:, None] * mass_k, axis=-1)
    n_min = jnp.sum(e >= min_p[:, None], axis=-1)
    n = jnp.maximum(1, jnp.minimum(jnp.minimum(n_k, n_p), n_min))
    return jnp.take_along_axis(srt, (n - 1)[:, None], axis=-1)[:, 0]


def _order_key(x: jax.Array) -> jax.Array:
    """uint32 keys that order like the float32 values (negatives bit-flipped, positives with the sign bit set)."""
    b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def _from_key(k: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k), jnp.float32)


def _largest_key(keys: jax.Array, weights: jax.Array, need: jax.Array) -> jax.Array:
    """Per row, the largest key K with sum(weights[keys >= K]) >= need: 32 passes, one per bit, from the top."""
    def bit(i: jax.Array, k: jax.Array) -> jax.Array:
        cand = k | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        mass = jnp.sum(jnp.where(keys >= cand[:, None], weights, 0), axis=-1)
        return jnp.where(mass >= need, cand, k)

    return jax.lax.fori_loop(0, 32, bit, jnp.zeros(keys.shape[:1], jnp.uint32))


def _filter_threshold_search(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """`_filter_threshold` without the sort: each filter's cut found by a bitwise search over the values' order
    keys (O(32 x vocab) per row), since XLA's CPU sort of a vocabulary's logits costs far more; see
    docs/tuning.md."""
    vocab = scaled.shape[-1]
    top = jnp.max(scaled, axis=-1)
    e = jnp.exp(scaled - top[:, None])
    keys = _order_key(scaled)
    use_k = (top_k > 0) & (top_k < vocab)
    k_key = jax.lax.cond(jnp.any(use_k),
                         lambda: jnp.where(use_k, _largest_key(keys, jnp.ones_like(e), top_k.astype(e.dtype)), 0),
                         lambda: jnp.zeros(keys.shape[:1], jnp.uint32))
    mass_k = jnp.sum(jnp.where(keys >= k_key[:, None], e, 0.0), axis=-1)
    use_p = top_p < 1.0
    p_key = jax.lax.cond(jnp.any(use_p), lambda: jnp.where(use_p, _largest_key(keys, e, top_p * mass_k), 0),
                         lambda: jnp.zeros(keys.shape[:1], jnp.uint32))
    t_min = jnp.min(jnp.where(e >= min_p[:, None], scaled, jnp.inf), axis=-1)
    t = jnp.maximum(jnp.where(use_k, _from_key(k_key), -jnp.inf), jnp.where(use_p, _from_key(p_key), -jnp.inf))
    t = jnp.maximum(t, jnp.where(min_p > 0, t_min, -jnp.inf))
    return jnp.minimum(t, top)  # at least the most likely token


def _draw(scaled: jax.Array, u: jax.Array) -> jax.Array:
    """Invert each row's CDF in vocabulary order at its uniform `u` (filtered tokens hold -inf)."""
    cum = jnp.cumsum(jnp.exp(scaled - scaled.max(axis=-1, keepdims=True)), axis=-1)
    j = jnp.sum(cum < u[:, None] * cum[:, -1:], axis=-1)
    return jnp.minimum(j, scaled.shape[-1] - 1)


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array, seed: jax.Array, step: jax.Array, want_logprobs: jax.Array,
                  processed: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Sample one token per row of float32 `logits` [S, V] (from `processed`, the logits after
    `logits_processing.process_logits`, when given).

    Returns (tokens [S], logprob of each token [S], top token ids [S, K], their logprobs [S, K]); the
    top-K arrays are zeros unless `want_logprobs`. Logprobs are of the unscaled, unprocessed model distribution
    (vLLM's default, `raw_logprobs`).
    """
    raw, logits = logits, logits if processed is None else processed
    greedy = first_argmax(logits)
    sampling = temperature > 0

    def draw() -> jax.Array:
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seed, step)
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
        scaled = logits / jnp.where(sampling, temperature, 1.0)[:, None]
        needs_cut = jnp.any(sampling & ((top_k > 0) | (top_p < 1.0) | (min_p > 0)))
        cut = _filter_threshold_search if jax.default_backend() == "cpu" else _filter_threshold
        threshold = jax.lax.cond(needs_cut, lambda: cut(scaled, top_k, top_p, min_p),
                                 lambda: jnp.full(scaled.shape[:1], -jnp.inf, scaled.dtype))
        return jnp.where(sampling, _draw(jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf), u), greedy)

    # All of sampling is skipped when every row is greedy: a greedy batch draws no random numbers and computes no
    # cut (docs/tuning.md).
    tokens = jax.lax.cond(jnp.any(sampling), draw, lambda: greedy).astype(jnp.int32)
    logits = raw
    lse = jax.nn.logsumexp(logits, axis=-1)
    token_logprob = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    k = min(NUM_TOP_LOGPROBS, logits.shape[-1])
    top_lp, top_ids = jax.lax.cond(
        want_logprobs, lambda: tuple(jax.lax.top_k(logits - lse[:, None], k)),
        lambda: (jnp.zeros((logits.shape[0], k), logits.dtype), jnp.zeros((logits.shape[0], k), jnp.int32)))
    return tokens, token_logprob, top_ids, top_lp


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` (the first index of each row's maximum) as two plain reductions, which XLA's CPU
    backend runs far faster than its argmax, a reduction over (value, index) pairs; see docs/tuning.md."""
    idx = jnp.where(x == jnp.max(x, axis=-1, keepdims=True), jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1])
    return jnp.minimum(jnp.min(idx, axis=-1), x.shape[-1] - 1).astype(jnp.int32)


class Sampler:
    """A runner's jitted sampler (logits of the hidden rows, then `sample_tokens`) in two variants: plain, and
    processed (logits_processing.py) for a step where some row has penalties, a bias or bans. Both compile per
    sampling bucket at warm-up (`warm`); `_cache_size` counts both, like a jitted function's."""

    def __init__(self, runner: Any, **jit_kwargs: Any) -> None:
        self.runner = runner
        self.vocab_size = int(nnx.merge(runner.graphdef, runner.params).embed[...].shape[0])
        self.history_len = runner.pages_per_seq * runner.page_size  # the penalties' token history
        self.plain = jax.jit(runner._sample_impl, **jit_kwargs)
        if "in_shardings" in jit_kwargs:  # the processing arrays are replicated like the sampling rows
            shardings = jit_kwargs["in_shardings"]
            jit_kwargs = {**jit_kwargs, "in_shardings": (*shardings, *(shardings[-1],) * 6)}
        self.processed = jax.jit(self._processed_impl, **jit_kwargs)

    def _processed_impl(self, param_leaves, hidden_rows, temperature, top_k, top_p, min_p, seed, step,
                        want_logprobs, *processing):
        r = self.runner
        model = nnx.merge(r.graphdef, jax.tree.unflatten(r._param_tree, param_leaves))
        logits = model.compute_logits(hidden_rows[: temperature.shape[0]], cpu_kernel=r.cpu_kernels,
                                      plan=r.kernel_plan)
        tokens, *rest = sample_tokens(logits, temperature, top_k, top_p, min_p, seed, step, want_logprobs,
                                      process_logits(logits, *processing))
        return (jnp.zeros(r.max_sampled, jnp.int32).at[: tokens.shape[0]].set(tokens), *rest)

    def __call__(self, param_leaves, hidden_rows, *rows: Any, requests: list | None = None) -> Any:
        """Draw for the step of `requests` (scheduler Requests; None entries and None: nothing to process)."""
        proc = Processing.build(requests or [], rows[0].shape[0], self.vocab_size, self.history_len)
        if proc is None:
            return self.plain(param_leaves, hidden_rows, *rows)
        return self.processed(param_leaves, hidden_rows, *rows, *self.runner._put(proc.arrays()))

    def warm(self, param_leaves, hidden_rows, *rows: Any) -> Any:
        """Compile both variants for these rows' sampling bucket; returns the plain one's output."""
        neutral = Processing.neutral(rows[0].shape[0], self.vocab_size, self.history_len)
        jax.block_until_ready(self.processed(param_leaves, hidden_rows, *rows, *self.runner._put(neutral.arrays())))
        return self.plain(param_leaves, hidden_rows, *rows)

    def _cache_size(self) -> int:
        return self.plain._cache_size() + self.processed._cache_size()
