"""Rejection sampling of proposed tokens that keeps the target distribution exactly (Leviathan et al., Chen et al.).

Every logits row of a step is one token index of one sequence. A row with a draft token d (proposed with
probability q(d)) accepts it with probability min(1, p(d) / q(d)), p the target's distribution after the request's
temperature, top-k, top-p and min-p; a rejected row draws from max(0, p - q) renormalised. A row without a draft
(the bonus row after k accepted drafts, a plain decode, a prefill's first token) draws from p exactly as
`runner.sampler` does, with the same (seed, token index) uniform. For n-gram proposals q is a point mass on d:
the row draws its own token as the plain sampler does and accepts d iff that token is d (probability p(d), as
min(1, p(d)/q(d)) gives), so a seeded request emits the plain sampler's tokens whatever was proposed.
Greedy rows have p = one-hot(argmax): d is accepted iff it is the argmax, else the argmax is emitted, so greedy
output is the same token for token as without speculation.

Uniforms: a row's key is fold_in(key(seed), token index); its draw uses it as the plain sampler does, its accept
test fold_in(key, 1), the draft model's draw fold_in(key, 2): independent, and a token index whose draws were
used is never drawn again (the next step starts after it).

As in the plain sampler, what the rows need is decided on the host and passed as static arguments (`draw`: no row
samples, some sample, some cut; `cut`: the policy's method), so a jitted verify step holds no conditional.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.runner.sampling import draw_cdf, filter_threshold, first_argmax

ACCEPT_STREAM = 1
DRAFT_STREAM = 2


def row_keys(seed: jax.Array, step: jax.Array) -> jax.Array:
    """One key per row: the plain sampler's fold_in(key(seed), token index)."""
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seed, step)


def uniforms(keys: jax.Array, stream: int | None = None) -> jax.Array:
    """One uniform per row, from the row's key itself (stream None) or from fold_in(key, stream)."""
    if stream is not None:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, stream))(keys)
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                    min_p: jax.Array, *, draw: str, cut: str) -> jax.Array:
    """Each sampling row's logits scaled by its temperature, -inf outside its top-k / top-p / min-p cut when `draw`
    is "cut" (the plain sampler's); greedy rows are returned unscaled and unfiltered."""
    sampling = temperature > 0
    scaled = logits / jnp.where(sampling, temperature, 1.0)[:, None]
    if draw != "cut":
        return scaled
    threshold = filter_threshold(scaled, top_k, top_p, min_p, cut)
    return jnp.where(sampling[:, None] & (scaled < threshold[:, None]), -jnp.inf, scaled)


def probabilities(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array, *, draw: str, cut: str) -> jax.Array:
    """The distribution each row draws from: softmax of `filtered_logits`, one-hot at the argmax for greedy rows."""
    probs = jax.nn.softmax(filtered_logits(logits, temperature, top_k, top_p, min_p, draw=draw, cut=cut), axis=-1)
    greedy = jax.nn.one_hot(first_argmax(logits), logits.shape[-1], dtype=probs.dtype)
    return jnp.where((temperature > 0)[:, None], probs, greedy)


def draw_from(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Invert each row's CDF (vocabulary order) of unnormalised non-negative `probs` at `u`."""
    cum = jnp.cumsum(probs, axis=-1)
    j = jnp.sum(cum < u[:, None] * cum[:, -1:], axis=-1)
    return jnp.minimum(j, probs.shape[-1] - 1).astype(jnp.int32)


def sample_draft(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                 seed: jax.Array, step: jax.Array, *, draw: str, cut: str) -> tuple[jax.Array, jax.Array]:
    """The draft model's proposals: (token [R], the distribution q it was drawn from [R, V]). An all-greedy batch
    (`draw` "greedy") returns q = 0, which verification reads as "any q" (a greedy target accepts iff d is its
    argmax)."""
    greedy = first_argmax(logits)
    if draw == "greedy":
        return greedy, jnp.zeros_like(logits)
    q = probabilities(logits, temperature, top_k, top_p, min_p, draw=draw, cut=cut)
    u = uniforms(row_keys(seed, step), DRAFT_STREAM)
    return jnp.where(temperature > 0, draw_from(q, u), greedy), q


def verify(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
           seed: jax.Array, step: jax.Array, draft: jax.Array, q: jax.Array | None, *, draw: str,
           cut: str) -> tuple[jax.Array, jax.Array]:
    """Per row: (accepted [R] bool, emitted token [R]): the draft when accepted, else the row's own draw (from the
    residual after a rejected draft, from p where there was none). `draft` is -1 on rows without one; `q` [R, V]
    holds each row's draft distribution, None for point-mass (n-gram) proposals; `draw` ("greedy": no row samples)
    and `cut` as in `sampling.draw_tokens`."""
    has = draft >= 0
    d = jnp.maximum(draft, 0)
    greedy = first_argmax(logits)

    def all_greedy() -> tuple[jax.Array, jax.Array]:
        return has & (d == greedy), greedy

    def general() -> tuple[jax.Array, jax.Array]:
        keys = row_keys(seed, step)
        u = uniforms(keys)
        plain = jnp.where(temperature > 0, draw_cdf(filtered_logits(logits, temperature, top_k, top_p, min_p,
                                                                    draw=draw, cut=cut), u), greedy)
        if q is None:  # a point mass: accepted iff the row's own draw is d, which happens with probability p(d)
            return has & (plain == d), plain
        p = probabilities(logits, temperature, top_k, top_p, min_p, draw=draw, cut=cut)
        p_d = jnp.take_along_axis(p, d[:, None], axis=-1)[:, 0]
        q_d = jnp.take_along_axis(q, d[:, None], axis=-1)[:, 0]
        accepted = has & (uniforms(keys, ACCEPT_STREAM) * q_d < p_d)
        residual = jnp.maximum(p - q, 0.0)
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p)
        own = jnp.where(has, draw_from(residual, u), plain)
        return accepted, own

    accepted, own = all_greedy() if draw == "greedy" else general()
    return accepted, jnp.where(accepted, d, own).astype(jnp.int32)
