"""The scheduler driven by a fake paged model (tests/scheduler_driver.py): budgets, chunking, prefix hits,
preemption, aborts and no leaks, every step checked against the budgets and the integrity check."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.request import RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.stops import check_token_stop
from jaxserve.scheduler.kv_cache_manager import KVCacheManager
from jaxserve.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler_driver import VOCAB, Driver, make_request, make_scheduler, outputs_of

# ---- examples ---------------------------------------------------------------------------------------


def test_one_step_mixes_decodes_and_prefill_chunks_decodes_first() -> None:
    driver = Driver(make_scheduler(), 64)
    sched = driver.scheduler
    sched.add_request(make_request("short", [1, 2, 3]))
    first = driver.step()
    assert first is not None and first.num_decodes == 0 and first.samples.tolist() == [True]
    sched.add_request(make_request("long", list(range(1, 101))))
    mixed = driver.step()
    assert mixed is not None
    assert [r.request_id for r in mixed.requests] == ["short", "long"]
    assert mixed.num_decodes == 1
    assert mixed.num_tokens == 1 + 32  # one decode token plus a 32-token chunk
    assert mixed.samples.tolist() == [True, False]
    driver.run()
    assert len(driver.finished["long"].output_token_ids) == 8


def test_prompt_is_prefilled_in_page_aligned_chunks_within_the_token_budget() -> None:
    driver = Driver(make_scheduler(max_num_batched_tokens=30, chunk_size=24), 64)
    req = make_request("a", list(range(1, 61)))
    driver.scheduler.add_request(req)
    tree = driver.scheduler.kv.tree
    chunks = []
    while True:
        batch = driver.step()
        assert batch is not None
        chunks.append(batch.num_tokens)
        # each chunk extends the request's own cached path, page by page
        full = req.num_computed_tokens // 4
        assert tree is not None and tree.match_prefix(req.prompt_token_ids, touch=False).page_ids[:full] == \
            req.page_ids[:full]
        assert tree.num_locked == full
        if batch.samples[0]:
            break
    assert chunks == [24, 24, 12]  # 24 = min(chunk, budget) floored to pages; the last chunk finishes
    driver.run()


def test_max_num_seqs_caps_running_requests() -> None:
    driver = Driver(make_scheduler(max_num_seqs=2), 64)
    for i in range(5):
        driver.scheduler.add_request(make_request(f"r{i}", [i + 1] * 5))
    driver.step()
    assert driver.scheduler.num_running == 2 and driver.scheduler.num_waiting == 3
    driver.run()
    assert len(driver.finished) == 5


def test_prefix_hits_are_counted_and_reported() -> None:
    driver = Driver(make_scheduler(), 64)
    sched = driver.scheduler
    system = list(range(1, 33))
    sched.add_request(make_request("a", system + [40, 41]))
    driver.step()
    stats = sched.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (34, 0)
    driver.run()
    sched.add_request(make_request("b", system + [42, 43, 44]))
    driver.step()
    stats = sched.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (35, 32)
    assert sched.get_request("b") is not None and sched.get_request("b").num_cached_tokens == 32
    assert driver.batches[-1].num_tokens == 3  # only the uncached suffix is prefilled
    driver.run()


def test_the_next_turn_of_a_conversation_hits_the_previous_answer() -> None:
    driver = Driver(make_scheduler(), 64)
    turn1 = make_request("turn1", list(range(1, 19)), max_tokens=10)
    driver.scheduler.add_request(turn1)
    driver.run()
    history = turn1.all_token_ids  # 18 prompt + 10 answer tokens; KV computed for 27 of them
    driver.scheduler.add_request(make_request("turn2", history + [7, 7, 7]))
    driver.step()
    assert driver.scheduler.get_request("turn2").num_cached_tokens == 27  # 24 in pages, 3 in the last one's tail


def test_a_second_request_hits_the_pages_of_one_still_prefilling() -> None:
    driver = Driver(make_scheduler(max_num_batched_tokens=16, chunk_size=16), 64)
    prompt = list(range(1, 65))
    driver.scheduler.add_request(make_request("first", prompt))
    driver.step()
    driver.step()  # first has computed 32 tokens, cached as they completed
    driver.scheduler.add_request(make_request("second", prompt + [99]))
    while driver.scheduler.get_request("second").num_cached_tokens is None:
        driver.step()
    assert driver.scheduler.get_request("second").num_cached_tokens >= 32
    driver.run()


def test_salted_requests_never_hit_each_other() -> None:
    driver = Driver(make_scheduler(), 64)
    prompt = list(range(1, 30))
    driver.scheduler.add_request(make_request("a", prompt, salt="tenant-a"))
    driver.run()
    for rid, salt in [("b", "tenant-b"), ("c", None)]:
        driver.scheduler.add_request(make_request(rid, prompt, salt=salt))
        driver.step()
        assert driver.scheduler.get_request(rid).num_cached_tokens == 0
        driver.run()


def test_never_fitting_requests_are_rejected_with_clear_errors() -> None:
    sched = make_scheduler(num_pages=11, max_model_len=100)  # 10 usable pages of 4 tokens = 40 tokens
    with pytest.raises(ValueError, match=r"maximum context length is 100 tokens\. However, you requested 110 tokens"):
        sched.add_request(make_request("too-long", [1] * 90, max_tokens=20))
    with pytest.raises(ValueError, match="needs 11 KV pages of 4 tokens, but the whole KV pool has 10"):
        sched.add_request(make_request("too-big", [1] * 40, max_tokens=2))
    with pytest.raises(ValueError, match="prompt is empty"):
        sched.add_request(make_request("empty", []))
    sched.add_request(make_request("fits", [1] * 40, max_tokens=1))  # exactly the whole pool
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("fits", [1]))
    assert sched.num_waiting == 1


def test_config_rejects_impossible_budgets() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        SchedulerConfig(chunk_size=0)
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="random")
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        Scheduler(SchedulerConfig(), KVCacheManager(8, 16, enable_prefix_caching=False))


def test_abort_frees_pages_at_once_whether_waiting_or_running() -> None:
    driver = Driver(make_scheduler(max_num_seqs=1), 64)
    sched = driver.scheduler
    sched.add_request(make_request("running", list(range(1, 40))))
    sched.add_request(make_request("waiting", list(range(1, 40))))
    driver.step()
    assert sched.kv.usage() > 0
    assert sched.abort_request("waiting") and sched.abort_request("running")
    assert sched.kv.usage() == 0.0 and not sched.has_work()
    assert not sched.abort_request("running")  # already gone
    sched.integrity_check()


def test_forced_preemption_recomputes_the_newest_request_and_requeues_it_at_the_front() -> None:
    # 8 usable pages of 4 tokens. Two requests of 8-token prompts that decode 16 tokens each need 6 pages
    # apiece eventually; together they outgrow the pool and the newer one must be preempted.
    config = dict(max_num_seqs=2, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    driver = Driver(make_scheduler(num_pages=9, **config), 9)
    sched = driver.scheduler
    old, new = make_request("old", [1] * 8, max_tokens=16), make_request("new", [2] * 8, max_tokens=16)
    sched.add_request(old)
    sched.add_request(new)
    sched.add_request(make_request("later", [3] * 4, max_tokens=2))
    while sched.num_preemptions == 0:
        driver.step()
    assert sched.stats().num_preemptions == 1
    assert new.status == RequestStatus.WAITING and new.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["new", "later"]  # at the front, ahead of "later"
    assert new.num_computed_tokens == 0 and new.page_ids == []
    assert old.status == RequestStatus.RUNNING
    generated_before = list(new.output_token_ids)
    driver.run()
    assert driver.finished["new"].output_token_ids[: len(generated_before)] == generated_before
    assert outputs_of([old, new]) == {"old": old.output_token_ids, "new": new.output_token_ids}


def test_preemption_under_pressure_keeps_outputs_identical() -> None:
    rng = random.Random(0)
    system = [rng.randrange(1, VOCAB) for _ in range(12)]
    requests = [make_request(f"r{i}", system + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 20))],
                             max_tokens=rng.randrange(1, 24)) for i in range(12)]
    roomy = outputs_of(requests, num_pages=200)
    tight_driver = Driver(make_scheduler(num_pages=16), 16)
    for r in requests:
        tight_driver.scheduler.add_request(make_request(r.request_id, r.prompt_token_ids, r.max_tokens))
    tight_driver.run()
    assert tight_driver.scheduler.num_preemptions > 0
    assert {rid: r.output_token_ids for rid, r in tight_driver.finished.items()} == roomy
    assert outputs_of(requests, enable_prefix_caching=False, num_pages=16) == roomy
    assert outputs_of(requests, chunk_size=4, max_num_batched_tokens=8) == roomy
    assert outputs_of(requests, page_size=8, chunk_size=64, num_pages=40) == roomy


def test_async_scheduling_serves_the_same_tokens_under_pressure() -> None:
    """One step ahead, decodes carry placeholders for tokens not yet seen; preemption, prefix hits and tight
    pages still give every request the tokens of the synchronous loop (the fake model checks every context)."""
    rng = random.Random(0)
    system = [rng.randrange(1, VOCAB) for _ in range(12)]
    requests = [make_request(f"r{i}", system + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 20))],
                             max_tokens=rng.randrange(1, 24)) for i in range(12)]
    roomy = outputs_of(requests, num_pages=200)
    tight = Driver(make_scheduler(num_pages=16), 16, async_scheduling=True)
    for r in requests:
        tight.scheduler.add_request(make_request(r.request_id, r.prompt_token_ids, r.max_tokens))
    tight.run()
    assert tight.scheduler.num_preemptions > 0 and tight.scheduler.kv.num_hit_tokens > 0
    assert {rid: r.output_token_ids for rid, r in tight.finished.items()} == roomy
    assert outputs_of(requests, async_scheduling=True, chunk_size=4, max_num_batched_tokens=8) == roomy
    assert all(t >= 0 for r in tight.finished.values() for t in r.output_token_ids)


def test_the_admission_reservation_for_decode_growth_keeps_preemption_rare() -> None:
    def preemptions(init_ratio: float, min_ratio: float) -> int:
        rng = random.Random(0)
        sched = make_scheduler(num_pages=40, max_num_seqs=16, init_new_token_ratio=init_ratio,
                               min_new_token_ratio=min_ratio)
        driver = Driver(sched, 40)
        for i in range(40):
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 20))]
            sched.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(8, 40)))
        driver.run()
        return sched.num_preemptions

    without_reservation = preemptions(0.0, 0.0)
    assert without_reservation > 10
    assert preemptions(0.7, 0.1) * 10 <= without_reservation
    assert preemptions(1.0, 1.0) == 0  # reserving every future token never preempts


def test_longest_prefix_match_policy_prefers_cached_prompts_and_falls_back_to_fcfs() -> None:
    def admission_order(policy: str, lpm_max_queue: int = 128) -> list[str]:
        driver = Driver(make_scheduler(max_num_seqs=1, policy=policy, lpm_max_queue=lpm_max_queue), 64)
        sched = driver.scheduler
        sched.add_request(make_request("warm", [5] * 16, max_tokens=1))
        driver.run()
        sched.add_request(make_request("cold", [6] * 16, max_tokens=1))
        sched.add_request(make_request("hot", [5] * 16 + [1], max_tokens=1))
        order = []
        while sched.has_work():
            batch = driver.step()
            order += [r.request_id for r in batch.requests if r.request_id not in order]
        return order

    assert admission_order("fcfs") == ["cold", "hot"]
    assert admission_order("lpm") == ["hot", "cold"]
    assert admission_order("lpm", lpm_max_queue=1) == ["cold", "hot"]


def test_token_level_stop_conditions() -> None:
    req = make_request("r", [1, 2], max_tokens=3)
    req.eos_token_id = 9
    req.sampling_params = SamplingParams(max_tokens=3, stop_token_ids=[7])
    assert check_token_stop(req) is None
    req.output_token_ids = [9]
    assert check_token_stop(req) == RequestStatus.FINISHED_STOPPED and req.stop_reason is None
    req.output_token_ids = [7]
    assert check_token_stop(req) == RequestStatus.FINISHED_STOPPED and req.stop_reason == 7
    req.output_token_ids = [1, 2, 3]
    assert check_token_stop(req) == RequestStatus.FINISHED_LENGTH
    req.sampling_params = SamplingParams(max_tokens=3, ignore_eos=True)
    req.output_token_ids = [9]
    assert check_token_stop(req) is None
    assert check_token_stop(req, max_model_len=3) == RequestStatus.FINISHED_LENGTH


# ---- properties -------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       page_size=st.sampled_from([1, 2, 4, 8]),
       num_pages=st.integers(12, 80),
       max_num_seqs=st.integers(1, 8),
       chunk_size=st.integers(1, 24),
       budget=st.integers(1, 48),
       caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "lpm"]),
       async_scheduling=st.booleans())
def test_random_workloads_respect_budgets_and_leak_nothing(seed: int, page_size: int, num_pages: int,
                                                           max_num_seqs: int, chunk_size: int,
                                                           budget: int, caching: bool,
                                                           policy: str, async_scheduling: bool) -> None:
    """Random submit / abort / finish with random shared prefixes: every step checked, nothing lost."""
    rng = random.Random(seed)
    sched = make_scheduler(num_pages, page_size=page_size, chunk_size=chunk_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=budget, enable_prefix_caching=caching,
                           policy=policy, max_model_len=200)
    driver = Driver(sched, num_pages, async_scheduling)
    capacity = (num_pages - 1) * page_size
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
    submitted, aborted = 0, 0
    for step in range(120):
        if rng.random() < 0.4:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 30)] + [rng.randrange(1, VOCAB)
                                                                      for _ in range(rng.randrange(0, 12))]
            max_tokens = rng.randrange(1, 16)
            req = make_request(f"r{step}", prompt, max_tokens, salt=rng.choice([None, None, "s"]))
            if len(prompt) + max_tokens - 1 > capacity:
                with pytest.raises(ValueError):
                    sched.add_request(req)
            else:
                sched.add_request(req)
                submitted += 1
        if sched.requests and rng.random() < 0.1:
            aborted += sched.abort_request(rng.choice(sorted(sched.requests)))
            sched.integrity_check()
        if sched.running and rng.random() < 0.05:  # the engine stops one early (a stop string, say)
            stopped = rng.choice(sched.running)
            sched.finish_request(stopped, RequestStatus.FINISHED_STOPPED)
            driver.finished[stopped.request_id] = stopped
            sched.integrity_check()
        driver.step()
    driver.run()
    assert len(driver.finished) + aborted == submitted
    assert sched.kv.usage() == 0.0 and sched.kv.num_free_pages == num_pages - 1
    sched.integrity_check()


def test_thousands_of_requests_with_shared_prefixes_leak_no_page() -> None:
    rng = random.Random(1234)
    num_pages = 48
    sched = make_scheduler(num_pages, max_num_seqs=16, max_num_batched_tokens=48, chunk_size=16)
    driver = Driver(sched, num_pages)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(24)] for _ in range(6)]
    aborted = 0
    for i in range(2000):
        prompt = rng.choice(prefixes)[: rng.randrange(1, 25)] + [rng.randrange(1, VOCAB)
                                                                 for _ in range(rng.randrange(0, 8))]
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 12)))
        if rng.random() < 0.05:
            aborted += sched.abort_request(f"r{rng.randrange(0, i + 1)}")
        if i % 2:
            driver.step()
    driver.run()
    assert len(driver.finished) + aborted == 2000
    assert sched.kv.num_hit_tokens > 0 and sched.kv.num_evicted_pages > 0
    assert sched.kv.usage() == 0.0
    sched.integrity_check()
