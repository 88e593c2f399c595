"""The engine end to end on the `tiny` preset: batching, chunking, paging and preemption never change a
request's tokens; stops, seeds and aborts behave as vLLM's do; nothing compiles after warm-up."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE_ARGS

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(3, 150))).tolist() for _ in range(n)]


def test_greedy_output_is_the_same_alone_and_among_fifteen_others(tiny_llm):
    batch = prompts(16)
    together = tiny_llm.generate(batch, GREEDY)
    alone = tiny_llm.generate([batch[7]], GREEDY)[0]
    assert together[7].token_ids == alone.token_ids
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in together)


@pytest.mark.parametrize("overrides", [dict(chunk_size=16), dict(chunk_size=1024, max_num_batched_tokens=1024),
                                       dict(page_size=64, chunk_size=64)])
def test_chunk_and_page_size_do_not_change_tokens(tiny_llm, overrides):
    batch = prompts(4, seed=1)
    expected = [o.token_ids for o in tiny_llm.generate(batch, GREEDY)]
    other = LLM(model="tiny", **{**TINY_ENGINE_ARGS, **overrides})
    assert [o.token_ids for o in other.generate(batch, GREEDY)] == expected


def test_preempted_requests_recompute_the_same_tokens(tiny_llm):
    batch = prompts(8, seed=2)
    expected = [o.token_ids for o in tiny_llm.generate(batch, GREEDY)]
    # Room for only a few sequences at once: admission over-commits, decodes run out of pages, preemption.
    cramped = LLM(model="tiny", **{**TINY_ENGINE_ARGS, "kv_cache_memory": 40 * 16 * 512, "max_model_len": 512})
    outs = cramped.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert cramped.engine.counters["num_preemptions"] > 0
    assert any(o.metrics.num_preemptions > 0 for o in outs)
    cramped.engine.scheduler.integrity_check()
    assert cramped.engine.kv_manager.num_used_pages == 0


def test_nothing_compiles_after_warmup(tiny_llm):
    before = tiny_llm.engine.runner.compile_count()
    mixed = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=5, seed=1),
             SamplingParams(temperature=0, max_tokens=9, logprobs=2),
             SamplingParams(temperature=1.0, top_k=3, min_p=0.1, max_tokens=3)]
    batch = prompts(13, seed=3)
    tiny_llm.generate(batch, [mixed[i % 3] for i in range(13)])
    tiny_llm.generate(prompts(1, seed=4), mixed[0])
    assert tiny_llm.engine.runner.compile_count() == before


def test_same_seed_same_output_whatever_else_runs(tiny_llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = tiny_llm.generate(["The quick brown fox"], p)[0].token_ids
    others = [SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True)] * 5
    crowd = tiny_llm.generate(["abc", "The quick brown fox", "x" * 80, "hello", "zz", "q"], [others[0], p, *others[1:]])
    assert crowd[1].token_ids == alone


def test_stop_strings_cut_the_text_and_max_tokens_bounds_it(tiny_llm):
    free = tiny_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 32
    stop = free.text[5:7]
    cut = tiny_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.text == free.text[: free.text.find(stop)]


def test_stop_token_ids_end_the_request_on_that_token(tiny_llm):
    free = tiny_llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    target = free.token_ids[4]
    out = tiny_llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[target],
                                                          ignore_eos=True))[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(target) + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == target


def test_timestamps_are_ordered_and_tpot_is_the_mean_gap_after_the_first_token(tiny_llm):
    out = tiny_llm.generate(["timing"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert len(m.token_times) == 8 and m.ttft > 0
    assert m.tpot == pytest.approx((m.token_times[-1] - m.first_token_time) / 7)


def test_n_completions_and_too_long_prompts(tiny_llm):
    out = tiny_llm.generate(["n"], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and len({tuple(c.token_ids) for c in out.outputs}) > 1
    with pytest.raises(ValueError, match="maximum context length is 1024 tokens"):
        tiny_llm.generate([[5] * 1000], SamplingParams(max_tokens=100))


def test_abort_frees_pages_at_once(tiny_llm):
    engine = tiny_llm.engine
    engine.add_request("to-abort", "a long-running request", SamplingParams(max_tokens=500, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_manager.num_used_pages > 0
    out = engine.abort_request("to-abort")
    assert out.finished and out.finish_reason == "abort"
    assert engine.kv_manager.num_used_pages == 0 and not engine.has_unfinished_requests()
    engine.scheduler.integrity_check()


def test_a_request_that_fails_internally_fails_alone(tiny_llm):
    engine = tiny_llm.engine
    engine.add_request("healthy", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.add_request("broken", [4, 5, 6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))

    def explode(req):
        raise RuntimeError("detokenizer exploded")

    engine._tracked["broken"].stops.check = explode
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["broken"].finish_reason == "abort" and "detokenizer exploded" in finished["broken"].error
    assert len(finished["healthy"].token_ids) == 4 and finished["healthy"].error is None
    assert engine.kv_manager.num_used_pages == 0


def test_step_stats_describe_the_step_and_the_budget_can_change(tiny_llm):
    engine = tiny_llm.engine
    engine.set_step_budget(32, 32)
    try:
        engine.add_request("long", list(range(100)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        engine.step()
        first = engine.last_step
        assert first.num_tokens == 32 and first.prefill_chunks == [(32, 0)] and not first.compiled
        engine.step()
        assert engine.last_step.prefill_chunks == [(32, 32)]
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.last_step.decode_context_tokens == 101 and engine.last_step.prefill_chunks == []
        with pytest.raises(ValueError, match="largest compiled bucket"):
            engine.set_step_budget(10**6)
    finally:
        engine.set_step_budget(TINY_ENGINE_ARGS["max_num_batched_tokens"], TINY_ENGINE_ARGS["chunk_size"])


def test_warmup_work_touches_only_the_trash_page():
    """Warm-up runs small buckets with real work; all of its KV lands in page 0, never in a page a request gets."""
    llm = LLM(model="tiny", **{**TINY_ENGINE_ARGS, "chunk_size": 32, "max_num_batched_tokens": 32, "warmup": True})
    k, v = (np.asarray(x) for x in llm.engine.runner.kv_caches[0])
    assert np.abs(k[0]).sum() > 0 and np.abs(v[0]).sum() > 0
    assert not k[1:].any() and not v[1:].any()
