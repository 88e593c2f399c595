"""Workload generators and arrival processes of `jaxserve bench`."""

import math

import numpy as np
import pytest

from jaxserve.measure.bench.datasets import DatasetConfig, generate
from jaxserve.measure.bench.load import LoadConfig, arrival_offsets

VOCAB = 512


def test_random_lengths_within_range_and_seeded():
    cfg = DatasetConfig(name="random", num_prompts=200, input_len=100, output_len=20, range_ratio=0.25, seed=3)
    reqs = generate(cfg, VOCAB, (257,))
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 75 and max(ins) <= 125 and len(set(ins)) > 10
    assert min(outs) >= 15 and max(outs) <= 25
    assert all(257 not in r.prompt and all(0 <= t < VOCAB for t in r.prompt) for r in reqs)
    again = generate(cfg, VOCAB, (257,))
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    other = generate(DatasetConfig(name="random", num_prompts=200, input_len=100, output_len=20, seed=4), VOCAB)
    assert other[0].prompt != reqs[0].prompt


def test_range_ratio_zero_gives_exact_lengths():
    reqs = generate(DatasetConfig(num_prompts=5, input_len=33, output_len=7), VOCAB)
    assert {r.prompt_len for r in reqs} == {33} and {r.output_len for r in reqs} == {7}


def test_shared_prefixes_are_really_shared():
    cfg = DatasetConfig(name="shared-prefix", num_prompts=12, input_len=80, prefix_len=48, num_prefixes=3,
                        output_len=4)
    reqs = generate(cfg, VOCAB)
    assert all(r.prompt_len == 80 for r in reqs)
    groups = [reqs[k::3] for k in range(3)]
    for g in groups:
        assert all(r.prompt[:48] == g[0].prompt[:48] for r in g)
        assert len({tuple(r.prompt[48:]) for r in g}) == len(g)  # suffixes differ
    assert len({tuple(g[0].prompt[:48]) for g in groups}) == 3


def test_multi_turn_prompts_grow_and_chain():
    cfg = DatasetConfig(name="multi-turn", num_prompts=8, turns=4, input_len=10, output_len=5)
    reqs = generate(cfg, VOCAB)
    assert len(reqs) == 8
    for conv in (reqs[:4], reqs[4:]):
        assert conv[0].wait_for is None
        for prev, cur in zip(conv, conv[1:], strict=False):
            assert cur.prompt[: prev.prompt_len] == prev.prompt
            assert cur.prompt_len == prev.prompt_len + prev.output_len + 10
            assert reqs[cur.wait_for] is prev and cur.wait_tokens is None


def test_long_prompt_waits_for_the_first_decode():
    cfg = DatasetConfig(name="long-prompt", num_prompts=4, input_len=16, output_len=30, long_prompt_len=200,
                        warm_tokens=5)
    reqs = generate(cfg, VOCAB)
    assert [r.role for r in reqs] == ["decode"] * 3 + ["long"]
    assert reqs[-1].prompt_len == 200 and reqs[-1].wait_for == 0 and reqs[-1].wait_tokens == 5


def test_bad_dataset_config():
    with pytest.raises(ValueError):
        DatasetConfig(name="nope")
    with pytest.raises(ValueError):
        DatasetConfig(range_ratio=1.0)
    with pytest.raises(ValueError):
        LoadConfig(request_rate=0)


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gamma_arrivals_have_the_asked_rate_and_dispersion(burstiness):
    rate, n = 8.0, 40_000
    t = arrival_offsets(n, rate, burstiness, seed=1)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # Gamma(shape=b): coefficient of variation 1/sqrt(b); 1 for Poisson.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_poisson_counts_per_window_are_poisson():
    t = arrival_offsets(20_000, 5.0, 1.0, seed=2)
    counts = np.bincount(t.astype(int))[:-1]  # arrivals per 1-second window
    assert counts.mean() == pytest.approx(5.0, rel=0.05)
    assert counts.var() == pytest.approx(5.0, rel=0.15)  # variance = mean


def test_infinite_rate_sends_everything_at_once():
    assert np.all(arrival_offsets(7, math.inf) == 0)


def test_default_lengths_fit_the_servers_context() -> None:
    from jaxserve.measure.bench.datasets import fit_lengths

    assert fit_lengths(8192) == (512, 64)
    assert fit_lengths(512) == (448, 64)  # bard: 512 + 64 would not fit
    assert fit_lengths(256, range_ratio=0.5) == (138, 32)  # the longest request, 207 + 48, still fits
    assert fit_lengths(512, "multi-turn", turns=4) == (112, 16)  # the last turn holds all four messages and answers
    assert fit_lengths(512, input_len=100, output_len=10) == (100, 10)  # given lengths are kept
    with pytest.raises(ValueError, match="leaves no room"):
        fit_lengths(64, output_len=64)
