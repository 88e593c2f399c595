"""Speculative decoding with async scheduling: the next round is dispatched, chained on the device to the round in
flight, before that round is collected. Nothing a client sees may change: greedy output is plain decoding's (with
chunked prefill, preemption, prefix hits and aborts in flight), and so is seeded output with n-gram lookup."""

import dataclasses

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.hlo_checks import conditionals, dynamic_while_loops, host_round_trips
from tests.test_spec_decode_engine import ARGS, DRAFT, GREEDY, NGRAM, _prompts, _run


def _overlapped(config: dict, warmup: bool = True) -> LLM:
    llm = LLM("tiny", **ARGS, speculative_config=config, async_scheduling=True, warmup=warmup)
    runner = llm.engine.runner  # overlap every round (a CPU's policy runs rounds wider than 8 tokens alone)
    runner.policy = dataclasses.replace(runner.policy, overlap_max_tokens=None)
    return llm


@pytest.fixture(scope="module")
def plain():
    return LLM("tiny", **ARGS, warmup=False)  # the reference: it compiles only what the tests run


@pytest.fixture(scope="module")
def chained_ngram():
    """One overlapped n-gram engine for the module: each warm engine here compiles for a minute or more."""
    return _overlapped(NGRAM)


@pytest.fixture(scope="module")
def collected_ngram():
    """The synchronous loop's n-gram engine, whose rounds the overlapped one must reproduce (no test counts its
    compiles: it compiles what the tests run)."""
    return LLM("tiny", **ARGS, speculative_config=NGRAM, warmup=False)


@pytest.fixture(scope="module", params=["ngram", "draft"])
def spec(request):
    if request.param == "ngram":
        return request.getfixturevalue("chained_ngram")
    return _overlapped(DRAFT, warmup=False)  # no test here counts its compiles: it compiles what the tests run


def _chained(llm: LLM) -> int:
    return llm.engine.stats()["spec_decode_num_chained_rounds"]


def test_greedy_output_is_unchanged_with_chunked_prefill_and_preemption(plain, spec):
    prompts = _prompts(4, 72)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    preempted, chained = spec.engine.counters["num_preemptions"], _chained(spec)
    sched = spec.engine.scheduler
    saved = sched.config.init_new_token_ratio, sched.config.min_new_token_ratio, sched.new_token_ratio
    sched.config.init_new_token_ratio = sched.config.min_new_token_ratio = sched.new_token_ratio = 0.0
    try:
        assert _run(spec, prompts, params) == _run(plain, prompts, params)
    finally:
        sched.config.init_new_token_ratio, sched.config.min_new_token_ratio, sched.new_token_ratio = saved
    assert spec.engine.counters["num_preemptions"] > preempted
    # counted once each, though chained rounds run without a schedule() of their own
    assert spec.engine.counters["num_preemptions"] == spec.engine.scheduler.num_preemptions
    assert _chained(spec) > chained + 20  # most rounds were dispatched before the one before them was collected
    assert spec.engine.kv_manager.num_used_pages == 0
    spec.engine.scheduler.integrity_check()


def test_greedy_output_is_unchanged_with_prefix_cache_hits(plain, spec):
    shared = _prompts(1, 80, seed=1)[0]
    prompts = [shared + [5, 6, 7], shared + [9]]
    first = spec.generate(prompts[:1], GREEDY)[0]
    second = spec.generate(prompts[1:], GREEDY)[0]
    assert second.num_cached_tokens >= 64
    assert [first.token_ids, second.token_ids] == _run(plain, prompts)


def test_aborts_in_flight_leave_the_others_unchanged(plain, spec):
    prompts = _prompts(3, 70, seed=4)
    want = _run(plain, prompts)
    eng = spec.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"abort-{i}", p, GREEDY)
    done, aborted = {}, False
    for _ in range(400):
        if not eng.has_unfinished_requests():
            break
        if not aborted and spec.engine.loop.flight is not None and _chained(spec) > 2:  # a round in flight
            assert eng.abort_request("abort-1").finish_reason == "abort"
            aborted = True
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        eng.scheduler.integrity_check()
    assert aborted and done == {"abort-0": want[0], "abort-2": want[2]}
    assert eng.kv_manager.num_used_pages == 0


def test_stops_inside_a_chained_round_cut_there(plain, spec):
    prompt = _prompts(1, 60, seed=9)
    ref = _run(plain, prompt)[0]
    params = SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[ref[20]], ignore_eos=True)
    out = spec.generate(prompt, params)[0]
    assert out.token_ids == ref[: ref.index(ref[20]) + 1] and out.finish_reason == "stop"
    assert spec.engine.kv_manager.num_used_pages == 0


def test_seeded_ngram_output_is_plain_decodings(plain, chained_ngram):
    ngram = chained_ngram
    prompts = _prompts(3, 50, seed=6)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=24, ignore_eos=True)
              for i in range(3)]
    assert _run(ngram, prompts, params) == _run(plain, prompts, params)
    before = ngram.engine.compile_count()
    # seeded: what the lookup finds must not depend on what the shared engine drew before
    outs = ngram.generate(prompts, [SamplingParams(temperature=0.7, max_tokens=20, logprobs=2, seed=21 + i)
                                    for i in range(3)])
    assert all(len(o.outputs[0].logprobs) == len(o.token_ids) for o in outs)
    assert ngram.engine.compile_count() == before
    assert np.all([o.metrics.spec_num_steps > 0 for o in outs])


def test_a_round_holds_no_branch_and_no_device_bound_loop(spec):
    # draft forward, k draws, verify forward, acceptance and carry: one program the device runs without the host
    rnd = spec.engine.loop.round
    text = rnd.lower(rnd.idle_inputs(rnd.sizes[-1])).as_text()
    assert conditionals(text) == [] and dynamic_while_loops(text) == [] and host_round_trips(text) == []


def test_chained_rounds_propose_what_a_collected_round_would(collected_ngram, chained_ngram):
    # n-gram lookup on the device once the round in flight is known: the rounds a synchronous loop runs, where a
    # guess on the host (before that round was known) wasted the round after each partly accepted one
    collected, chained = collected_ngram, chained_ngram
    prompts = _prompts(2, 120, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    before = _chained(chained)
    want, got = collected.generate(prompts, params), chained.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert _chained(chained) > before
    steps = [(o.metrics.spec_num_steps, o.metrics.spec_num_draft_tokens, o.metrics.spec_num_accepted_tokens)
             for o in (*want, *got)]
    assert steps[2:] == steps[:2]  # rounds, drafts and accepted drafts of each request



def test_rounds_whose_lookup_found_nothing_are_counted(collected_ngram, chained_ngram):
    # where the answer writes tokens its context never held, a chained round verifies nothing: one token for a
    # round's cost, counted as spec_decode_num_empty_rounds (a synchronous loop runs a plain step there instead)
    collected, chained = collected_ngram, chained_ngram
    prompts = _prompts(1, 100, seed=3)  # its continuation holds a ten-token stretch with no match
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    empty = chained.engine.stats()["spec_decode_num_empty_rounds"]
    want, got = collected.generate(prompts, params)[0], chained.generate(prompts, params)[0]
    assert got.token_ids == want.token_ids
    m = want.metrics
    plain_steps = len(want.token_ids) - 1 - m.spec_num_accepted_tokens - m.spec_num_steps  # the lookup found nothing
    assert plain_steps >= 8
    assert 0 < chained.engine.stats()["spec_decode_num_empty_rounds"] - empty <= plain_steps + 1
    assert collected.engine.stats()["spec_decode_num_empty_rounds"] == 0  # its rounds all carry the host's drafts
