"""The batched sampler: filters, seeds and logprobs, on hand-made logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.runner.sampler import TIERS, SamplingArrays, tier_for
from jaxserve.runner.sampling import filter_threshold_search, filter_threshold_sort, sample_tokens


def draw(logits: np.ndarray, rows: list[tuple[SamplingParams, int, int]], cut: str = "search"):
    """What the engine's sampler draws for these rows: the tier the host picks for them, the CPU's cut."""
    a = SamplingArrays.build(rows, len(rows))
    how, want_top, _ = TIERS[tier_for(a)]
    sample = jax.jit(lambda *x: sample_tokens(*x, draw=how, want_top=want_top, cut=cut))
    return [np.asarray(x) for x in sample(np.asarray(logits, np.float32), *a.rows())]


@pytest.fixture(scope="module")
def logits() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32) * 2


def test_greedy_rows_take_the_argmax(logits):
    tokens, *_ = draw(logits, [(SamplingParams(temperature=0), 0, 0)] * 4)
    assert (tokens == logits.argmax(-1)).all()


def test_greedy_ties_take_the_first_maximum():
    tied = np.zeros((3, 50), np.float32)
    tied[0, [7, 3, 40]] = 5.0  # first of three equal maxima: 3
    tied[1, [49, 48]] = 1.0
    tokens, *_ = draw(tied, [(SamplingParams(temperature=0), 0, 0)] * 3)
    assert tokens.tolist() == [3, 48, 0] == tied.argmax(-1).tolist()


def test_a_seeded_row_draws_the_same_token_whatever_its_neighbours(logits):
    p = SamplingParams(temperature=1.0, seed=7)
    alone, *_ = draw(logits[:1], [(p, 7, 3)])
    other = SamplingParams(temperature=0.7, top_k=5)
    batch = np.concatenate([logits[2:3], logits[:1], logits[3:4]])
    crowded, *_ = draw(batch, [(other, 1, 0), (p, 7, 3), (other, 2, 9)])
    assert alone[0] == crowded[1]


def test_different_steps_and_seeds_draw_differently(logits):
    p = SamplingParams(temperature=5.0)
    row = np.repeat(logits[:1], 16, axis=0)
    tokens, *_ = draw(row, [(p, 1, step) for step in range(16)])
    assert len(set(tokens.tolist())) > 4


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=1),
                                    SamplingParams(temperature=1.0, top_p=1e-6),
                                    SamplingParams(temperature=1.0, min_p=1.0)])
def test_filters_that_keep_one_token_are_greedy(logits, params):
    tokens, *_ = draw(logits, [(params, s, 0) for s in range(4)])
    assert (tokens == logits.argmax(-1)).all()


def test_top_k_draws_only_among_the_k_largest(logits):
    row = np.repeat(logits[:1], 64, axis=0)
    tokens, *_ = draw(row, [(SamplingParams(temperature=10.0, top_k=3), s, 0) for s in range(64)])
    top3 = set(np.argsort(-logits[0])[:3].tolist())
    assert set(tokens.tolist()) <= top3 and len(set(tokens.tolist())) == 3


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    row = np.repeat(np.log(probs)[None].astype(np.float32), 200, axis=0)
    tokens, *_ = draw(row, [(SamplingParams(temperature=1.0, top_p=0.7), s, 0) for s in range(200)])
    assert set(tokens.tolist()) == {0, 1}


def test_plain_sampling_follows_the_softmax():
    probs = np.array([0.6, 0.3, 0.1])
    row = np.repeat(np.log(probs)[None].astype(np.float32), 2000, axis=0)
    tokens, *_ = draw(row, [(SamplingParams(temperature=1.0), s, 0) for s in range(2000)])
    freq = np.bincount(tokens, minlength=3) / 2000
    assert np.abs(freq - probs).max() < 0.04


def test_logprobs_are_of_the_model_distribution(logits):
    tokens, lp, top_ids, top_lp = draw(logits, [(SamplingParams(temperature=0, logprobs=3), 0, 0)] * 4)
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp, ref[np.arange(4), tokens], rtol=1e-5, atol=1e-5)
    assert (top_ids[:, 0] == tokens).all()
    np.testing.assert_allclose(top_lp[:, :3], -np.sort(-ref, axis=-1)[:, :3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [7, 300, 32000])
def test_the_cpu_search_cuts_where_the_sort_does(vocab):
    """The sort-free filter (CPU) keeps the sort's tokens: exactly for top-k and min-p; for top-p up to float
    rounding of the cumulative mass, which moves only tokens of negligible probability."""
    rng = np.random.default_rng(vocab)
    for _ in range(10):
        x = rng.standard_normal((6, vocab), dtype=np.float32) * rng.uniform(0.2, 5)
        top_k = np.array([0, 1, 3, vocab, 0, 2], np.int32)
        top_p = np.array([1.0, 1.0, 1.0, 0.9, 0.5, 0.7], np.float32)
        min_p = np.array([0.1, 0.0, 0.0, 0.0, 0.0, 0.05], np.float32)
        cuts = [np.asarray(jax.jit(f)(jnp.asarray(x), top_k, top_p, min_p))
                for f in (filter_threshold_sort, filter_threshold_search)]
        kept_sort, kept_search = (x >= c[:, None] for c in cuts)
        np.testing.assert_array_equal(kept_sort[:3], kept_search[:3])  # min-p, top-k 1 and 3: no sums involved
        prob = np.exp(x - x.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        moved = np.where(kept_sort != kept_search, prob, 0.0).sum(-1)
        assert (moved < 1e-4).all(), moved
        assert kept_search.any(-1).all()


def test_the_tier_is_the_cheapest_that_serves_every_row():
    greedy, lp = SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=1)
    hot, cut = SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_p=0.9)
    tier = lambda *ps: tier_for(SamplingArrays.build([(p, 0, 0) for p in ps], 4))  # noqa: E731
    assert tier(greedy, greedy) == "greedy"
    assert tier(greedy, lp) == "greedy_top"
    assert tier(greedy, hot) == "sample"
    assert tier(hot, cut, greedy) == "cut"
    assert tier_for(SamplingArrays.build([(greedy, 0, 0)], 4), processed=True) == "processed"
    assert tier(SamplingParams(temperature=0, top_p=0.5)) == "greedy"  # a greedy row's filters do nothing


@pytest.mark.parametrize("cut", ["sort", "search"])
def test_both_cuts_draw_the_same_tokens(logits, cut):
    rows = [(SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05), s, 3) for s in range(4)]
    np.testing.assert_array_equal(draw(logits, rows, cut)[0], draw(logits, rows, "sort")[0])
