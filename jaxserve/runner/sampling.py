"""Batched token sampling, as pure functions of the logits: greedy, temperature, top-k, top-p, min-p, seeded per row.

Each row draws one uniform number from `fold_in(key(seed), step)`, where `step` is the index of the token being
generated, and inverts the filtered distribution's CDF in vocabulary order. A request's samples therefore depend
only on its own logits, seed and position, never on what else shares the batch.

What a batch needs is known on the host when the batch is built, so it is passed as static arguments, never
decided on the device: `draw` is "greedy" (every row greedy: no random draw), "sample" (temperature only) or "cut"
(some row filters by top-k/top-p/min-p); `want_top` adds the top logprobs. A jitted step therefore holds no
conditional: on a GPU, XLA's conditional copies its predicate to the host and waits, every step. The cut is found
by sorting the vocabulary ("sort") or, where XLA's sort is slow (a CPU; docs/tuning.md), by a 32-pass bitwise
search over the values' order keys ("search"); the platform policy chooses which.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NUM_TOP_LOGPROBS = 20
DRAWS = ("greedy", "sample", "cut")
CUTS = ("sort", "search")


def filter_threshold_sort(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
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

    return jax.lax.fori_loop(0, 32, bit, jnp.zeros(keys.shape[:1], jnp.uint32))  # static trip count


def filter_threshold_search(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """`filter_threshold_sort` without the sort: each filter's cut found by a bitwise search over the values' order
    keys (O(32 x vocab) per row), since XLA's CPU sort of a vocabulary's logits costs far more; see
    docs/tuning.md."""
    vocab = scaled.shape[-1]
    top = jnp.max(scaled, axis=-1)
    e = jnp.exp(scaled - top[:, None])
    keys = _order_key(scaled)
    use_k = (top_k > 0) & (top_k < vocab)
    k_key = jnp.where(use_k, _largest_key(keys, jnp.ones_like(e), jnp.where(use_k, top_k, vocab).astype(e.dtype)), 0)
    mass_k = jnp.sum(jnp.where(keys >= k_key[:, None], e, 0.0), axis=-1)
    use_p = top_p < 1.0
    p_key = jnp.where(use_p, _largest_key(keys, e, top_p * mass_k), 0)
    t_min = jnp.min(jnp.where(e >= min_p[:, None], scaled, jnp.inf), axis=-1)
    t = jnp.maximum(jnp.where(use_k, _from_key(k_key), -jnp.inf), jnp.where(use_p, _from_key(p_key), -jnp.inf))
    t = jnp.maximum(t, jnp.where(min_p > 0, t_min, -jnp.inf))
    return jnp.minimum(t, top)  # at least the most likely token


def filter_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                     cut: str) -> jax.Array:
    """Per-row smallest kept logit, by the `cut` method ("sort" or "search"; equal results)."""
    if cut == "search":
        return filter_threshold_search(scaled, top_k, top_p, min_p)
    return filter_threshold_sort(scaled, top_k, top_p, min_p)


def draw_cdf(scaled: jax.Array, u: jax.Array) -> jax.Array:
    """Invert each row's CDF in vocabulary order at its uniform `u` (filtered tokens hold -inf)."""
    cum = jnp.cumsum(jnp.exp(scaled - scaled.max(axis=-1, keepdims=True)), axis=-1)
    j = jnp.sum(cum < u[:, None] * cum[:, -1:], axis=-1)
    return jnp.minimum(j, scaled.shape[-1] - 1)


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` (the first index of each row's maximum) as two plain reductions, which XLA's CPU
    backend runs far faster than its argmax, a reduction over (value, index) pairs; see docs/tuning.md."""
    idx = jnp.where(x == jnp.max(x, axis=-1, keepdims=True), jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1])
    return jnp.minimum(jnp.min(idx, axis=-1), x.shape[-1] - 1).astype(jnp.int32)


def row_uniforms(seed: jax.Array, step: jax.Array) -> jax.Array:
    """One uniform per row from fold_in(key(seed), step)."""
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seed, step)
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)


def draw_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                seed: jax.Array, step: jax.Array, *, draw: str, cut: str = "sort") -> jax.Array:
    """One token per row of `logits` [S, V]: greedy rows (temperature 0) the first argmax; sampling rows a seeded
    draw from their temperature-scaled distribution, cut by top-k/top-p/min-p when `draw` is "cut"."""
    greedy = first_argmax(logits)
    if draw == "greedy":
        return greedy
    sampling = temperature > 0
    scaled = logits / jnp.where(sampling, temperature, 1.0)[:, None]
    if draw == "cut":
        threshold = filter_threshold(scaled, top_k, top_p, min_p, cut)
        scaled = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)
    return jnp.where(sampling, draw_cdf(scaled, row_uniforms(seed, step)), greedy).astype(jnp.int32)


def logprobs_of(logits: jax.Array, tokens: jax.Array, want_top: bool) -> tuple[jax.Array, ...]:
    """The logprob of each row's token under `logits` (the unscaled, unprocessed model distribution, vLLM's
    `raw_logprobs`); with `want_top`, also the top NUM_TOP_LOGPROBS ids and logprobs of each row."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    token_logprob = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    if not want_top:
        return (token_logprob,)
    top_lp, top_ids = jax.lax.top_k(logits - lse[:, None], min(NUM_TOP_LOGPROBS, logits.shape[-1]))
    return token_logprob, top_ids, top_lp


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array, seed: jax.Array, step: jax.Array, *, draw: str, want_top: bool,
                  cut: str = "sort", processed: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Draw one token per row of float32 `logits` [S, V] (from `processed`, the logits after
    `logits_processing.process_logits`, when given) and its logprobs.

    Returns (tokens [S], logprob of each token [S]) and, with `want_top`, (top token ids [S, K], their logprobs
    [S, K]). `draw` and `cut` as in `draw_tokens`.
    """
    tokens = draw_tokens(logits if processed is None else processed, temperature, top_k, top_p, min_p, seed, step,
                         draw=draw, cut=cut)
    return (tokens, *logprobs_of(logits, tokens, want_top))
