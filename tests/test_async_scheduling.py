"""Asynchronous scheduling (`async_scheduling=True`): the host schedules step k while step k-1 runs, and step k's
decodes read step k-1's tokens on the device. Nothing a client sees may change: tokens, seeds, stops, prefix
hits, preemption and aborts behave as in the synchronous engine (the session's `tiny_llm`)."""

import dataclasses

import numpy as np
import pytest

import jaxserve.platform.policy
from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.core.batch import is_placeholder
from tests.conftest import TINY_ENGINE_ARGS

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def overlap_every_step(monkeypatch):
    """Overlap wide steps too (a CPU's platform policy collects steps wider than CPU_OVERLAP_MAX_TOKENS at once),
    so the placeholder path runs under every batch these tests make: in every engine a test builds."""
    monkeypatch.setattr(jaxserve.platform.policy, "CPU_OVERLAP_MAX_TOKENS", 10**9)


@pytest.fixture(scope="module")
def async_llm():
    with pytest.MonkeyPatch.context() as m:
        m.setattr(jaxserve.platform.policy, "CPU_OVERLAP_MAX_TOKENS", 10**9)
        return LLM(model="tiny", async_scheduling=True, **TINY_ENGINE_ARGS)


def overlap_up_to(monkeypatch, llm: LLM, tokens: int) -> None:
    """Within the test, `llm`'s overlapped loop runs steps wider than `tokens` alone (the CPU's rule at 8)."""
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "policy", dataclasses.replace(runner.policy, overlap_max_tokens=tokens))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(3, 150))).tolist() for _ in range(n)]


@pytest.mark.parametrize("overlap_max_tokens", [10**9, 8])  # every step overlapped; the CPU rule
def test_tokens_match_the_synchronous_engine_in_a_mixed_batch(tiny_llm, async_llm, monkeypatch, overlap_max_tokens):
    overlap_up_to(monkeypatch, async_llm, overlap_max_tokens)
    batch = prompts(16, seed=10)
    params = [SamplingParams(temperature=0, max_tokens=1 + i * 3 % 29, ignore_eos=True) if i % 3 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=20, ignore_eos=True) for i in range(16)]
    sync = tiny_llm.generate(batch, params)
    outs = async_llm.generate(batch, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
    assert [len(o.metrics.token_times) for o in outs] == [len(o.token_ids) for o in outs]
    assert async_llm.engine.kv_manager.num_used_pages == 0
    async_llm.engine.scheduler.integrity_check()


def test_stop_tokens_and_strings_end_requests_as_in_the_synchronous_engine(tiny_llm, async_llm):
    free = tiny_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    stop_id = free.token_ids[6]
    stops = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[stop_id]),
             SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[free.text[5:7]]),
             SamplingParams(temperature=0, max_tokens=32)]  # may end on EOS
    for params in stops:
        expected = tiny_llm.generate(["Hello", "other words"], params)
        got = async_llm.generate(["Hello", "other words"], params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
               [(o.token_ids, o.text, o.finish_reason) for o in expected]
    assert async_llm.engine.kv_manager.num_used_pages == 0


def test_preemption_under_async_scheduling_recomputes_the_same_tokens(tiny_llm):
    batch = prompts(8, seed=2)
    expected = [o.token_ids for o in tiny_llm.generate(batch, GREEDY)]
    cramped = LLM(model="tiny", async_scheduling=True,
                  **{**TINY_ENGINE_ARGS, "kv_cache_memory": 40 * 16 * 512, "max_model_len": 512})
    outs = cramped.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert cramped.engine.counters["num_preemptions"] > 0
    cramped.engine.scheduler.integrity_check()
    assert cramped.engine.kv_manager.num_used_pages == 0


def test_the_next_turn_hits_the_cache_and_decodes_the_same(tiny_llm, async_llm):
    first = prompts(1, seed=5)[0]
    answer = async_llm.generate([first], GREEDY)[0]
    turn = first + answer.token_ids + [7, 8, 9]
    got = async_llm.generate([turn], GREEDY)[0]
    assert got.num_cached_tokens >= (len(first) + len(answer.token_ids) - 1) // 16 * 16 - 16 > 0
    assert got.token_ids == tiny_llm.generate([turn], GREEDY)[0].token_ids


def test_abort_while_a_step_is_in_flight_frees_pages_and_the_id_can_be_reused(async_llm):
    engine = async_llm.engine
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    engine.add_request("flying", [1, 2, 3, 4, 5], params)
    engine.add_request("neighbour", [9, 8, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.loop.flight is not None  # a step is on the device while we abort
    out = engine.abort_request("flying")
    assert out.finished and out.finish_reason == "abort" and all(t >= 0 for t in out.token_ids)
    engine.add_request("flying", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(done["flying"].token_ids) == 3 and len(done["neighbour"].token_ids) == 6
    assert engine.kv_manager.num_used_pages == 0
    engine.scheduler.integrity_check()


def test_nothing_compiles_after_warmup_with_async_scheduling():
    """A fresh engine: the first step that reads a previous step's tokens on the device must not compile."""
    llm = LLM(model="tiny", async_scheduling=True, **{**TINY_ENGINE_ARGS, "max_num_seqs": 4, "warmup": True})
    before = llm.engine.runner.compile_count()
    llm.generate(prompts(6, seed=3), SamplingParams(temperature=0.7, max_tokens=5, seed=1, logprobs=2))
    llm.generate(prompts(1, seed=4), GREEDY)
    assert llm.engine.runner.compile_count() == before


def test_on_a_cpu_wide_steps_are_collected_at_once_and_narrow_ones_overlap(async_llm, monkeypatch):
    overlap_up_to(monkeypatch, async_llm, 8)
    engine = async_llm.engine
    engine.add_request("wide", list(range(1, 41)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()  # the 40-token prefill: collected in the same call
    assert engine.loop.flight is None and engine.scheduler.requests["wide"].output_token_ids[0] >= 0
    engine.step()  # a one-token decode: left in flight
    assert engine.loop.flight is not None and is_placeholder(engine.scheduler.requests["wide"].output_token_ids[-1])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_manager.num_used_pages == 0


def test_async_scheduling_needs_a_colocated_single_process_engine():
    with pytest.raises(ValueError, match="async_scheduling needs a colocated engine"):
        EngineConfig(async_scheduling=True, disaggregate=True)
    with pytest.raises(ValueError, match="async_scheduling needs a colocated engine"):
        EngineConfig(async_scheduling=True, num_processes=2, coordinator_address="localhost:1234")


def test_streaming_engine_with_async_scheduling_streams_and_aborts(tiny_llm):
    """The server's engine loop (AsyncEngine) on an overlapping engine: streams match the synchronous tokens,
    and a client that stops reading mid-stream aborts its request without disturbing the others."""
    import asyncio

    from jaxserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model="tiny", async_scheduling=True, **TINY_ENGINE_ARGS))
    engine.start()
    batch = prompts(3, seed=8)
    expected = [o.token_ids for o in tiny_llm.generate(batch, GREEDY)]

    async def stream(i: int, stop_after: int | None) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(f"s{i}", batch[i], GREEDY):
            tokens = out.outputs[0].token_ids
            if stop_after is not None and len(tokens) >= stop_after:
                break  # leaving the stream aborts the request
        return tokens

    async def main() -> list[list[int]]:
        return await asyncio.gather(stream(0, None), stream(1, 5), stream(2, None))

    try:
        full0, cut, full2 = asyncio.run(main())
        assert full0 == expected[0] and full2 == expected[2]
        assert cut[:5] == expected[1][:5] and len(cut) < 24
        deadline = 50
        while engine.engine.has_unfinished_requests() and deadline:  # the abort lands on the engine thread
            deadline -= 1
            asyncio.run(asyncio.sleep(0.1))
        assert not engine.engine.has_unfinished_requests()
        assert engine.engine.kv_manager.num_used_pages == 0
    finally:
        engine.shutdown()


def test_a_wide_step_after_an_overlapped_one_whose_request_stops(tiny_llm, monkeypatch):
    """The CPU rule's hand-over: a request stops on a token drawn by an overlapped (narrow) step while the next
    step, wide because a new prompt arrived, already holds it. Every arrival point is tried, each with a fresh
    prompt (a cached one would make the step narrow)."""
    monkeypatch.setattr(jaxserve.platform.policy, "CPU_OVERLAP_MAX_TOKENS", 8)
    free = tiny_llm.generate([[3, 1, 4, 1, 5]], GREEDY)[0].token_ids
    stopping = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[free[3]])
    expected_a = free[: free.index(free[3]) + 1]
    wides = [p + [1] * 20 for p in prompts(7, seed=9)]
    expected_b = [o.token_ids for o in tiny_llm.generate(wides, GREEDY)]
    llm = LLM(model="tiny", async_scheduling=True, **TINY_ENGINE_ARGS)
    engine = llm.engine
    for arrival, wide in enumerate(wides):
        engine.add_request(f"a{arrival}", [3, 1, 4, 1, 5], stopping)
        done = {}
        for _ in range(arrival):
            done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.add_request(f"b{arrival}", wide, GREEDY)
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert done[f"a{arrival}"].token_ids == expected_a and done[f"a{arrival}"].finish_reason == "stop"
        assert done[f"b{arrival}"].token_ids == expected_b[arrival]
        assert engine.kv_manager.num_used_pages == 0
