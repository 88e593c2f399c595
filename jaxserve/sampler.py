"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, with a per-request seed.

Each row draws one uniform number from `fold_in(key(seed), step)`, where `step` is the index of the token
being generated, and inverts the filtered distribution's CDF in vocabulary order. A request's samples
therefore depend only on its own logits, seed and position, never on what else shares the batch. The
vocabulary sort that top-k, top-p and min-p need runs only when some row asks for them (`lax.cond`), so
plain sampling stays O(vocab).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling_params import SamplingParams

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


def _draw(scaled: jax.Array, u: jax.Array) -> jax.Array:
    """Invert each row's CDF in vocabulary order at its uniform `u` (filtered tokens hold -inf)."""
    cum = jnp.cumsum(jnp.exp(scaled - scaled.max(axis=-1, keepdims=True)), axis=-1)
    j = jnp.sum(cum < u[:, None] * cum[:, -1:], axis=-1)
    return jnp.minimum(j, scaled.shape[-1] - 1)


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array, seed: jax.Array, step: jax.Array, want_logprobs: jax.Array,
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Sample one token per row of float32 `logits` [S, V].

    Returns (tokens [S], logprob of each token [S], top token ids [S, K], their logprobs [S, K]); the
    top-K arrays are zeros unless `want_logprobs`. Logprobs are of the unscaled model distribution.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seed, step)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    needs_sort = jnp.any((temperature > 0) & ((top_k > 0) | (top_p < 1.0) | (min_p > 0)))
    threshold = jax.lax.cond(needs_sort, lambda: _filter_threshold(scaled, top_k, top_p, min_p),
                             lambda: jnp.full(scaled.shape[:1], -jnp.inf, scaled.dtype))
    # The CDF scan is skipped when every row is greedy (about 1 ms of a 16-row step on CPU).
    drawn = jax.lax.cond(jnp.any(temperature > 0),
                         lambda: _draw(jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf), u),
                         lambda: greedy)
    tokens = jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    token_logprob = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    k = min(NUM_TOP_LOGPROBS, logits.shape[-1])
    top_lp, top_ids = jax.lax.cond(
        want_logprobs, lambda: tuple(jax.lax.top_k(logprobs, k)),
        lambda: (jnp.zeros((logits.shape[0], k), logits.dtype), jnp.zeros((logits.shape[0], k), jnp.int32)))
    return tokens, token_logprob, top_ids, top_lp
