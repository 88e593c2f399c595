"""Several decode steps a dispatch (`num_scheduler_steps=k`): while every running request decodes, one jitted call
draws up to k tokens per sequence, checking EOS, stop token ids and limits on the device; the host drops what a
sequence drew past its stop. Nothing a client sees may change against k = 1 (the session's `tiny_llm`)."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.core.batch import RaggedBatch
from jaxserve.runner.decode_run import DecodeRun
from tests.conftest import TINY_ENGINE_ARGS
from tests.step_outputs import tokens_each_step

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def multi_llm():
    return LLM(model="tiny", num_scheduler_steps=4, **TINY_ENGINE_ARGS)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(3, 150))).tolist() for _ in range(n)]


def test_greedy_and_seeded_tokens_match_one_step_dispatches(tiny_llm, multi_llm):
    batch = prompts(12, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=1 + i * 5 % 23, ignore_eos=True) if i % 3 else
              SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=i, max_tokens=19, ignore_eos=True)
              for i in range(12)]
    expected = tiny_llm.generate(batch, params)
    before = multi_llm.engine.counters["steps"]
    got = multi_llm.generate(batch, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [len(o.metrics.token_times) for o in got] == [len(o.token_ids) for o in got]
    generated = sum(len(o.token_ids) for o in got)
    assert multi_llm.engine.counters["steps"] - before < generated / 4  # most steps drew several tokens
    assert multi_llm.engine.kv_manager.num_used_pages == 0
    multi_llm.engine.scheduler.integrity_check()


def test_stops_end_requests_where_one_step_dispatches_do(tiny_llm, multi_llm):
    free = tiny_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    stop_id = free.token_ids[6]
    stops = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[stop_id]),
             SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[free.text[5:7]]),
             SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=list(range(5))),
             SamplingParams(temperature=0, max_tokens=32)]  # may end on EOS
    for params in stops:
        expected = tiny_llm.generate(["Hello", "other words"], params)
        got = multi_llm.generate(["Hello", "other words"], params)
        assert [(o.token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason) for o in got] == \
               [(o.token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason) for o in expected]
    assert multi_llm.engine.kv_manager.num_used_pages == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes_the_same_tokens(tiny_llm, prefix_caching):
    batch = prompts(8, seed=2)
    expected = [o.token_ids for o in tiny_llm.generate(batch, GREEDY)]
    cramped = LLM(model="tiny", num_scheduler_steps=3, **{**TINY_ENGINE_ARGS, "kv_cache_memory": 40 * 16 * 512,
                                                           "max_model_len": 512,
                                                           "enable_prefix_caching": prefix_caching})
    outs = cramped.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert cramped.engine.counters["num_preemptions"] > 0
    cramped.engine.scheduler.integrity_check()
    assert cramped.engine.kv_manager.num_used_pages == 0


def test_the_next_turn_hits_the_cache_and_decodes_the_same(tiny_llm, multi_llm):
    first = prompts(1, seed=5)[0]
    answer = multi_llm.generate([first], GREEDY)[0]
    turn = first + answer.token_ids + [7, 8, 9]
    got = multi_llm.generate([turn], GREEDY)[0]
    assert got.num_cached_tokens >= (len(first) + len(answer.token_ids) - 1) // 16 * 16 - 16 > 0
    assert got.token_ids == tiny_llm.generate([turn], GREEDY)[0].token_ids


def test_an_abort_between_dispatches_frees_pages_and_leaves_the_others_alone(tiny_llm, multi_llm):
    engine = multi_llm.engine
    neighbour = SamplingParams(temperature=0.8, seed=9, max_tokens=21, ignore_eos=True)
    engine.add_request("long", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    engine.add_request("neighbour", [9, 8, 7], neighbour)
    for _ in range(3):
        engine.step()
    out = engine.abort_request("long")
    assert out.finished and out.finish_reason == "abort" and len(out.token_ids) > 3
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["neighbour"].token_ids == tiny_llm.generate([[9, 8, 7]], neighbour)[0].token_ids
    assert engine.kv_manager.num_used_pages == 0
    engine.scheduler.integrity_check()


def test_requests_asking_for_logprobs_take_one_step_dispatches(tiny_llm, multi_llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    before = multi_llm.engine.counters["steps"]
    got = multi_llm.generate([[5, 6, 7]], params)[0]
    assert multi_llm.engine.counters["steps"] - before == 6  # a prefill, then one dispatch per token
    assert got.outputs[0].logprobs == tiny_llm.generate([[5, 6, 7]], params)[0].outputs[0].logprobs


def test_a_requests_last_run_stops_after_the_steps_it_needs(tiny_llm, multi_llm):
    runner = multi_llm.engine.loop.decode_runner
    runs = []
    execute = runner.execute

    def recording(batch, sampling, run):
        drawn = execute(batch, sampling, run)
        runs.append((run.limits.tolist(), drawn[:, 0].tolist()))
        return drawn

    runner.execute = recording
    try:
        params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
        got = multi_llm.generate([[5, 6, 7]], params)[0]
    finally:
        del runner.execute
    assert got.token_ids == tiny_llm.generate([[5, 6, 7]], params)[0].token_ids
    # the prompt's step draws one token; then runs of 4 and 2: the second's last two iterations never ran (a CPU's
    # policy ends the loop), so their rows hold nothing, where a static trip count repeats the last token
    assert [limits for limits, _ in runs] == [[4], [2]]
    assert runs[1][1] == got.token_ids[5:7] + [0, 0]


def test_a_run_gives_one_output_a_request_for_its_k_tokens(multi_llm):
    # outputs are cumulative: one describes every token a run kept for the request
    grew = tokens_each_step(multi_llm.engine, "run", prompts(1, seed=4)[0],
                            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert 4 in grew and sum(grew) == 10


def test_nothing_compiles_after_warmup():
    llm = LLM(model="tiny", num_scheduler_steps=4, **{**TINY_ENGINE_ARGS, "max_num_seqs": 4, "warmup": True})
    before = llm.engine.compile_count()
    llm.generate(prompts(6, seed=3), SamplingParams(temperature=0.7, max_tokens=9, seed=1))
    llm.generate(prompts(1, seed=4), GREEDY)
    assert llm.engine.compile_count() == before


def test_slots_past_a_sequences_limit_go_to_the_trash_page():
    class Req:
        sampling_params = SamplingParams(stop_token_ids=[42])
        eos_token_id = 3

    batch = RaggedBatch(requests=[Req(), Req()], num_decodes=2, token_ids=np.array([5, 6], np.int32),
                        positions=np.array([14, 3], np.int32), cu_q_lens=np.array([0, 1, 2], np.int32),
                        kv_lens=np.array([15, 4], np.int32), page_table=np.array([[7, 9], [4, 0]], np.int32),
                        slot_mapping=np.array([7 * 16 + 14, 4 * 16 + 3], np.int32),
                        logits_indices=np.array([0, 1], np.int32), samples=np.ones(2, bool))
    run = DecodeRun.build(batch, limits=[3, 1], k=3, page_size=16)
    # Sequence 0 crosses into its second page; sequence 1 may draw one token only.
    assert run.slots.tolist() == [[7 * 16 + 14, 4 * 16 + 3], [7 * 16 + 15, 0], [9 * 16 + 0, 0]]
    assert run.stop_ids.tolist() == [[42, 3, -1, -1, -1]] * 2


def test_several_steps_a_dispatch_need_the_synchronous_colocated_loop():
    with pytest.raises(ValueError, match="num_scheduler_steps > 1 needs the synchronous loop"):
        EngineConfig(num_scheduler_steps=4, async_scheduling=True)
    with pytest.raises(ValueError, match="num_scheduler_steps must be at least 1"):
        EngineConfig(num_scheduler_steps=0)
