"""Penalties, logit_bias, min_tokens and bad_words (vLLM's definitions) in the jitted sampler.

`process_logits` against a plain numpy reference of vLLM's rules on hand-made logits, then the engine (`tiny`):
each knob changes what is drawn the way it should, one-step dispatches are taken, nothing compiles after
warm-up, and a processed request draws the same whatever shares its batch.
"""

from collections import Counter

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core.request import Request
from jaxserve.runner.logits_processing import Processing, process_logits
from tests.conftest import TINY_ENGINE_ARGS

V, H = 70, 32
process = jax.jit(process_logits)


def reference(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams, eos: int) -> np.ndarray:
    """vLLM's sampler, one row: bans (bad words, min_tokens), logit_bias, repetition, frequency, presence."""
    x = logits.astype(np.float64).copy()
    banned = set()
    if len(output) < p.min_tokens:
        banned |= set(p.stop_token_ids) | ({eos} if not p.ignore_eos else set())
    for word in p.bad_words_token_ids or []:
        if len(word) == 1 or output[len(output) - len(word) + 1:] == word[:-1]:
            banned.add(word[-1])
    for t in banned:
        x[t] = -np.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def request(prompt: list[int], output: list[int], p: SamplingParams, eos: int = 3) -> Request:
    r = Request("r", list(prompt), p, 0.0, eos_token_id=eos)
    r.output_token_ids = list(output)
    return r


CASES = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5),
    SamplingParams(presence_penalty=2.0),
    SamplingParams(logit_bias={5: 100.0, 9: -250.0, 69: 3.5}),  # -250 is clamped to -100, as vLLM does
    SamplingParams(min_tokens=6, stop_token_ids=[11, 12]),
    SamplingParams(min_tokens=2, stop_token_ids=[11]),  # reached: nothing banned
    SamplingParams(bad_words=["x"], repetition_penalty=1.3, frequency_penalty=0.2, logit_bias={4: 1.0}),
]


@pytest.mark.parametrize("params", CASES)
def test_each_row_matches_the_reference(params: SamplingParams) -> None:
    rng = np.random.default_rng(0)
    params.bad_words_token_ids = [[7], [8, 9], [1, 2, 10]] if params.bad_words else None
    rows = [([1, 2, 2, 30], [8, 1, 2, 5, 5]), ([40, 41], []), (list(range(20)), [69, 69, 69]), ([6], [1, 2])]
    logits = rng.normal(size=(len(rows) + 1, V)).astype(np.float32) * 3
    reqs = [request(pr, out, params) for pr, out in rows] + [None]  # a padded row changes nothing
    proc = Processing.build(reqs, len(reqs), V, H)
    got = np.asarray(process(logits, *proc.arrays()))
    for i, (pr, out) in enumerate(rows):
        np.testing.assert_allclose(got[i], reference(logits[i], pr, out, params, eos=3), rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[-1], logits[-1])


def test_a_batch_without_processing_takes_the_plain_sampler() -> None:
    plain = SamplingParams(temperature=0.7, top_k=5)
    assert Processing.build([request([1], [2], plain), None], 2, V, H) is None
    assert Processing.build([request([1], [2], SamplingParams(min_tokens=1))], 1, V, H) is not None


def test_a_row_with_every_token_banned_keeps_its_logits() -> None:
    logits = np.arange(2 * V, dtype=np.float32).reshape(2, V)
    proc = Processing.neutral(2, V, H)
    proc.allowed[0] = 0  # nothing allowed: the row's raw logits are used rather than an all -inf row
    proc.allowed[1, 0] = 0b100  # only token 2 among the first 32
    proc.allowed[1, 1:] = 0
    got = np.asarray(process(logits, *proc.arrays()))
    np.testing.assert_array_equal(got[0], logits[0])
    assert np.isfinite(got[1]).tolist() == [i == 2 for i in range(V)]


@pytest.mark.parametrize("bad, message", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"), (dict(logit_bias={1: float("inf")}), "logit_bias"),
])
def test_invalid_values_name_their_field(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        SamplingParams(**bad)


# ---- the engine ----

PROMPT = [72, 101, 108, 108, 111, 44, 32]
GREEDY = dict(temperature=0, max_tokens=12)


def tokens(llm: LLM, **kw) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(**{**GREEDY, **kw}))[0].outputs[0].token_ids


def test_logit_bias_forces_and_forbids_tokens(tiny_llm: LLM) -> None:
    assert set(tokens(tiny_llm, logit_bias={65: 100.0}, ignore_eos=True)) == {65}
    free = tokens(tiny_llm, ignore_eos=True)
    without = tokens(tiny_llm, logit_bias={free[0]: -100.0}, ignore_eos=True)
    assert without[0] != free[0]


def test_penalties_change_a_repetitive_greedy_output(tiny_llm: LLM) -> None:
    free = tokens(tiny_llm, ignore_eos=True, max_tokens=24)
    assert len(set(free)) < len(free)  # random weights repeat themselves
    penalized = tokens(tiny_llm, ignore_eos=True, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0)
    assert len(set(penalized)) > len(set(free))
    repeated = tokens(tiny_llm, ignore_eos=True, max_tokens=24, repetition_penalty=2.0)
    assert repeated != free


def test_bad_words_never_appear(tiny_llm: LLM) -> None:
    pushed = dict(ignore_eos=True, max_tokens=16, logit_bias={65: 8.0})  # the model now wants "AAAA..."
    assert tokens(tiny_llm, **pushed).count(65) > 8
    assert 65 not in tokens(tiny_llm, **pushed, bad_words=["A"])  # a one-token word: never drawn
    pairs = tokens(tiny_llm, **pushed, bad_words=["AA"])  # a two-token word: its second token banned after "A"
    assert 65 in pairs and (65, 65) not in set(zip(pairs, pairs[1:], strict=False))


def test_min_tokens_holds_back_eos_and_stop_ids(tiny_llm: LLM) -> None:
    free = tokens(tiny_llm, ignore_eos=True, max_tokens=8)
    stop = free[2]  # a token the model draws third: a stop id that would end the request early
    early = tiny_llm.generate([PROMPT], SamplingParams(**GREEDY, stop_token_ids=[stop]))[0].outputs[0]
    assert len(early.token_ids) <= 3 and early.finish_reason == "stop"
    held = tiny_llm.generate([PROMPT], SamplingParams(**GREEDY, stop_token_ids=[stop], min_tokens=8))[0].outputs[0]
    assert len(held.token_ids) >= 8 and stop not in held.token_ids[:8]


def test_a_processed_request_draws_the_same_beside_others(tiny_llm: LLM) -> None:
    p = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, repetition_penalty=1.5,
                       logit_bias={100: 5.0})
    alone = tiny_llm.generate([PROMPT], p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 3
    crowded = tiny_llm.generate([[1, 2, 3], PROMPT, [9] * 40, [4]], [others[0], p, others[1], others[2]])
    assert crowded[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("engine_args", [dict(num_scheduler_steps=4), dict(async_scheduling=True)])
def test_other_loops_draw_what_the_synchronous_one_does(tiny_llm: LLM, engine_args: dict) -> None:
    llm = LLM(model="tiny", **{**TINY_ENGINE_ARGS, "max_num_seqs": 4, "warmup": True}, **engine_args)
    before = llm.engine.compile_count()
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True, presence_penalty=1.5,
                             min_tokens=4)]
    prompts = [PROMPT, [5, 6, 7], [200, 201]]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params)]
    assert llm.engine.compile_count() == before  # the processed sampler compiled at warm-up
