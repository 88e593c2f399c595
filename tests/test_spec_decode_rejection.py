"""Rejection sampling keeps the target distribution exactly: many seeded draws on a small vocabulary."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.runner.sampling import sample_tokens
from jaxserve.spec_decode.rejection import probabilities, sample_draft, verify

V = 6
N = 40000  # draws per case: rows of one batch, each its own seed
KW = dict(draw="cut", cut="sort")  # the general tier: right for every row, whatever its filters
TARGET = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5], np.float32)
DRAFT = np.array([0.0, 2.0, 0.0, 1.0, 0.0, -2.0], np.float32)  # a poor draft: mass where the target has little


def _rows(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return (jnp.full(N, temperature, jnp.float32), jnp.full(N, top_k, jnp.int32), jnp.full(N, top_p, jnp.float32),
            jnp.full(N, min_p, jnp.float32), jnp.arange(N, dtype=jnp.uint32), jnp.full(N, 7, jnp.int32))


def _assert_distribution(tokens: np.ndarray, p: np.ndarray) -> None:
    """Chi-square goodness of fit; p-value 1e-4 (a correct sampler fails one run in ten thousand)."""
    counts = np.bincount(tokens, minlength=V)
    support = p > 0
    assert counts[~support].sum() == 0, f"drew tokens the target excludes: {counts}"
    p64 = p[support].astype(np.float64)
    expected = p64 / p64.sum() * len(tokens)
    pvalue = stats.chisquare(counts[support], expected).pvalue
    assert pvalue > 1e-4, f"counts {counts} against expected {np.round(p * len(tokens))}: p = {pvalue:.2e}"


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.7), dict(top_k=3), dict(top_p=0.8),
                                    dict(min_p=0.2, temperature=1.3)])
def test_draft_model_proposals_keep_the_target_distribution(params):
    rows = _rows(**params)
    target = jnp.broadcast_to(TARGET, (N, V))
    draft_logits = jnp.broadcast_to(DRAFT, (N, V))
    d, q = sample_draft(draft_logits, *rows, **KW)
    accepted, tokens = verify(target, *rows, d, q, **KW)
    p = np.asarray(probabilities(target[:1], *(x[:1] for x in rows[:4]), **KW))[0]
    _assert_distribution(np.asarray(tokens), p)
    acc = float(np.mean(np.asarray(accepted)))
    expected = float(np.sum(np.minimum(p, np.asarray(q[0]))))  # P(accept) = sum_x min(p(x), q(x))
    assert abs(acc - expected) < 0.02


@pytest.mark.parametrize("draft_token", [0, 3, 4])
def test_point_mass_proposals_keep_the_target_distribution(draft_token):
    rows = _rows(temperature=0.9)
    target = jnp.broadcast_to(TARGET, (N, V))
    accepted, tokens = verify(target, *rows, jnp.full(N, draft_token, jnp.int32), None, **KW)
    p = np.asarray(probabilities(target[:1], *(x[:1] for x in rows[:4]), **KW))[0]
    _assert_distribution(np.asarray(tokens), p)
    assert abs(float(np.mean(np.asarray(accepted))) - p[draft_token]) < 0.02  # n-gram: accepted with p(d)


def test_rows_without_a_draft_draw_as_the_plain_sampler():
    rows = _rows(temperature=0.8, top_p=0.9)
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(N, V)), jnp.float32)
    _, tokens = verify(logits, *rows, jnp.full(N, -1, jnp.int32), None, **KW)
    plain, *_ = sample_tokens(logits, *rows, draw="cut", want_top=False, cut="sort")
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(plain))


def test_greedy_rows_accept_exactly_the_argmax():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(64, V)), jnp.float32)
    greedy = np.argmax(np.asarray(logits), axis=-1)
    drafts = np.where(np.arange(64) % 2 == 0, greedy, (greedy + 1) % V).astype(np.int32)
    zeros = jnp.zeros(64, jnp.float32)
    rows = (zeros, jnp.zeros(64, jnp.int32), jnp.ones(64), zeros, jnp.arange(64, dtype=jnp.uint32),
            jnp.zeros(64, jnp.int32))
    for q, how in itertools.product((None, jnp.zeros((64, V)), jax.nn.one_hot(drafts, V)), ("greedy", "cut")):
        accepted, tokens = verify(logits, *rows, jnp.asarray(drafts), q, draw=how, cut="sort")
        np.testing.assert_array_equal(np.asarray(accepted), drafts == greedy)
        np.testing.assert_array_equal(np.asarray(tokens), greedy)


def test_a_mixed_batch_keeps_greedy_rows_greedy():
    """One sampling row switches the whole batch to the general path; the greedy rows stay exact."""
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(8, V)), jnp.float32)
    greedy = np.argmax(np.asarray(logits), axis=-1)
    temperature = jnp.array([0, 0, 0, 1.0, 0, 0, 0, 0], jnp.float32)
    drafts = jnp.asarray(((greedy + np.arange(8) % 2) % V).astype(np.int32))
    rows = (temperature, jnp.zeros(8, jnp.int32), jnp.ones(8), jnp.zeros(8), jnp.arange(8, dtype=jnp.uint32),
            jnp.zeros(8, jnp.int32))
    accepted, tokens = verify(logits, *rows, drafts, jnp.zeros((8, V)), **KW)
    g = np.asarray(temperature) == 0
    np.testing.assert_array_equal(np.asarray(tokens)[g], greedy[g])
    np.testing.assert_array_equal(np.asarray(accepted)[g], (np.asarray(drafts) == greedy)[g])
