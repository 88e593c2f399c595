"""Prefix caching end to end on the `tiny` preset: cached KV never changes greedy tokens (with caching off,
other chunk sizes, or preemption forced), a conversation's next turn hits the previous answer, salts isolate
tenants, and the accounting adds up."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE_ARGS

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PAGE = TINY_ENGINE_ARGS["page_size"]


def shared_prefix_prompts(n: int, seed: int, prefix_len: int = 100) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, size=prefix_len).tolist()
    return [system + rng.integers(0, 256, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def uncached_llm():
    return LLM(model="tiny", **{**TINY_ENGINE_ARGS, "enable_prefix_caching": False, "chunk_size": 16})


def test_cached_prefixes_give_the_same_tokens_as_no_cache(tiny_llm, uncached_llm):
    batch = shared_prefix_prompts(6, seed=10)
    tiny_llm.generate(batch[:1], GREEDY)  # warms the cache with the shared system prompt
    cached = tiny_llm.generate(batch, GREEDY)
    assert all(o.num_cached_tokens >= 96 for o in cached)  # the 100-token prefix, in whole pages
    assert all(o.metrics.num_cached_tokens == o.num_cached_tokens for o in cached)
    uncached = uncached_llm.generate(batch, GREEDY)
    assert [o.token_ids for o in uncached] == [o.token_ids for o in cached]
    assert all(o.num_cached_tokens == 0 for o in uncached)
    assert uncached_llm.engine.kv_manager.num_hit_tokens == 0


def test_forced_preemption_with_caching_gives_the_same_tokens(tiny_llm):
    batch = shared_prefix_prompts(8, seed=11, prefix_len=40)
    expected = [o.token_ids for o in tiny_llm.generate(batch, SamplingParams(temperature=0, max_tokens=48,
                                                                              ignore_eos=True))]
    cramped = LLM(model="tiny", **{**TINY_ENGINE_ARGS, "kv_cache_memory": 40 * 16 * 512, "max_model_len": 512,
                                   "chunk_size": 32})
    # Force over-admission: no room reserved for decode growth, so decodes run out of pages and preempt.
    scheduler = cramped.engine.scheduler
    scheduler.config.init_new_token_ratio = scheduler.config.min_new_token_ratio = 0.0
    scheduler.new_token_ratio = 0.0
    outs = cramped.generate(batch, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    engine = cramped.engine
    assert engine.counters["num_preemptions"] > 0
    engine.scheduler.integrity_check()
    assert engine.kv_manager.num_used_pages == 0


def test_the_next_turn_hits_the_previous_answer(tiny_llm, uncached_llm):
    rng = np.random.default_rng(12)
    turn1 = rng.integers(0, 256, size=40).tolist()
    answer = tiny_llm.generate([turn1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    turn2 = turn1 + answer.token_ids + rng.integers(0, 256, size=5).tolist()
    out = tiny_llm.generate([turn2], GREEDY)[0]
    # KV exists for 40 + 30 - 1 tokens (the last sampled token was never fed back): whole pages, then the
    # partial last page, which turn 2 takes over and writes on from token 70
    assert (40 + 30 - 1) % PAGE and out.num_cached_tokens == 40 + 30 - 1
    assert out.token_ids == uncached_llm.generate([turn2], GREEDY)[0].token_ids
    turn3 = turn2 + out.token_ids + [1, 2]
    third = tiny_llm.generate([turn3], GREEDY)[0]
    assert third.num_cached_tokens == len(turn2) + 16 - 1
    assert third.token_ids == uncached_llm.generate([turn3], GREEDY)[0].token_ids
    tiny_llm.engine.scheduler.integrity_check()


def test_salted_requests_never_hit_each_other(tiny_llm):
    prompt = shared_prefix_prompts(1, seed=13)[0]
    a = tiny_llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    b = tiny_llm.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    again = tiny_llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(prompt) - 1) // PAGE * PAGE
    assert a.token_ids == b.token_ids == again.token_ids


def test_accounting_adds_up(tiny_llm):
    engine = tiny_llm.engine
    before = dict(engine.counters)
    batch = shared_prefix_prompts(3, seed=14)
    outs = tiny_llm.generate(batch, GREEDY)
    queried = engine.counters["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = engine.counters["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert queried == sum(len(p) for p in batch)
    assert hits == sum(o.num_cached_tokens for o in outs)
    engine.scheduler.integrity_check()
    kv = engine.kv_manager
    assert kv.num_used_pages == 0 and kv.usage() == 0.0
    assert kv.allocator.num_free + kv.num_evictable_pages == kv.num_usable_pages
