"""`--speculative-config`: vLLM's JSON, one dataclass, one-line errors (exit 2 on the command line)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_helpers import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.config.engine import EngineConfig
from jaxserve.config.speculative import SpeculativeConfig, parse_speculative_config
from jaxserve.spec_decode.ngram import lookup_on_device, ngram_propose


def test_ngram_config_as_vllm_spells_it():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                   '"prompt_lookup_min": 1}')
    assert cfg == SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=1)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_max": 3}).prompt_lookup_min == 3


def test_draft_model_config_and_the_engine_config_holds_it():
    cfg = EngineConfig(speculative_config={"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3})
    assert cfg.speculative_config == SpeculativeConfig("draft_model", 3, model="tiny")


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of"),
    ('{"method": "ngram"}', "needs \"num_speculative_tokens\""),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown field(s) lookahead"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "exceeds prompt_lookup_max"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs \"model\""),
])
def test_bad_configs_are_one_line_errors(text, message):
    with pytest.raises(ValueError) as e:
        parse_speculative_config(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_speculation_runs_with_async_scheduling_but_not_k_steps_a_dispatch():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, async_scheduling=True)
    assert config.async_scheduling and config.supports_async_scheduling
    with pytest.raises(ValueError, match="one-round-a-step loop"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, num_scheduler_steps=4)


@pytest.mark.parametrize("value", ["{oops", '{"method": "ngram", "num_speculative_tokens": 2, "x": 1}'])
def test_the_flag_exits_2_with_one_line(value):
    code, err = run_cli("generate", "--model", "tiny", "--prompt", "hi", "--speculative-config", value)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: speculative_config"), err


def test_ngram_lookup_proposes_what_followed_the_longest_match():
    assert ngram_propose([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 4) == [4, 5, 1]  # "1 2 3" matched: 4 5 1 followed it
    assert ngram_propose([7, 1, 2, 9, 8, 1, 2], 2, 1, 4) == [9, 8]
    assert ngram_propose([5, 6, 1, 7, 2, 1], 4, 1, 4) == [7, 2, 1]  # only "1" matches; at most what follows
    assert ngram_propose([1, 2, 3], 3, 1, 4) == []
    assert ngram_propose([4, 1, 9, 1, 8, 1], 1, 1, 1) == [8]  # the most recent earlier occurrence
    assert ngram_propose([1, 2, 3, 1], 3, 2, 4) == []  # shorter than prompt_lookup_min


def _ngram_by_windows(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The lookup by its definition: every n from the longest down, every earlier window of n tokens."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        hits = [i for i in range(size - n) if tokens[i: i + n] == tokens[size - n:]]
        if hits:
            return tokens[hits[-1] + n: hits[-1] + n + k]
    return []


@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 5), st.integers(1, 3),
       st.integers(1, 6))
def test_ngram_lookup_is_the_longest_most_recent_earlier_match(tokens, k, min_n, max_n):
    assert ngram_propose(tokens, k, min_n, max(min_n, max_n)) == _ngram_by_windows(tokens, k, min_n,
                                                                                  max(min_n, max_n))


@given(st.lists(st.integers(0, 2), min_size=1, max_size=40), st.integers(1, 5), st.integers(1, 3),
       st.integers(1, 6))
def test_a_frequent_newest_token_is_looked_up_in_one_pass_to_the_same_match(tokens, k, min_n, max_n):
    from jaxserve.spec_decode import ngram

    saved, ngram.PYTHON_CANDIDATES = ngram.PYTHON_CANDIDATES, 2  # past two occurrences: numpy's one pass
    try:
        got = ngram_propose(np.asarray(tokens), k, min_n, max(min_n, max_n))
    finally:
        ngram.PYTHON_CANDIDATES = saved
    assert got == _ngram_by_windows(tokens, k, min_n, max(min_n, max_n))
    assert all(type(t) is int for t in got)


_on_device = jax.jit(lookup_on_device, static_argnums=(5, 6, 7))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=24), st.lists(st.integers(0, 3), min_size=4, max_size=4),
       st.integers(0, 4), st.integers(0, 3), st.integers(0, 4), st.integers(1, 2), st.integers(0, 2))
def test_the_devices_lookup_is_the_hosts_on_the_tokens_known_after_a_round(known, drafts, accepted, last, room,
                                                                            min_n, extra):
    # a chained round's lookup: the known tokens, the drafts the round before accepted, then its own token
    window = np.full(24, -1, np.int32)
    window[24 - len(known):] = known
    props, real = _on_device(jnp.asarray(window), jnp.asarray(drafts, jnp.int32), accepted, last, room, 4, min_n,
                             min_n + extra)
    real = np.asarray(real)
    assert list(real) == sorted(real, reverse=True)  # the proposals are a prefix of the k rows
    want = ngram_propose(known + drafts[:accepted] + [last], room, min_n, min_n + extra) if room else []
    assert np.asarray(props)[real].tolist() == want
