"""The KV-cache manager: admission with prefix hits, growth with eviction, caching of full pages, release."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.scheduler.kv_cache_manager import KVCacheManager

PS = 4


def make_request(rid: str, prompt: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=8), arrival_time=0.0, max_tokens=8,
                   cache_salt=salt)


def compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """What a step does to a request's KV: allocate, compute n tokens, cache the pages that became full."""
    assert kv.allocate(req, n)
    req.num_computed_tokens += n
    kv.cache_full_pages(req)


def serve_prompt(kv: KVCacheManager, req: Request) -> None:
    kv.admit(req)
    compute(kv, req, req.num_tokens - req.num_computed_tokens)


def test_a_repeated_prompt_hits_all_but_its_last_token_in_whole_pages() -> None:
    kv = KVCacheManager(num_pages=16, page_size=PS)
    prompt = list(range(1, 10))  # 9 tokens: 2 full pages + 1
    first = make_request("a", prompt)
    assert kv.admit(first) == 0 and first.num_cached_tokens == 0
    compute(kv, first, 9)
    kv.free(first)
    assert kv.usage() == 0.0  # cached, unlocked pages count as free
    assert kv.tree is not None and kv.tree.num_pages == 2

    second = make_request("b", prompt)
    assert kv.admit(second) == 8  # capped at 8 = 9 - 1 tokens, i.e. two whole pages
    assert second.num_computed_tokens == 8 and second.num_cached_tokens == 8
    assert kv.num_queried_tokens == 18 and kv.num_hit_tokens == 8

    exact = make_request("c", prompt[:8])  # 8 tokens: the cap 7 floors to one page
    assert kv.admit(exact) == 4
    kv.integrity_check()


def test_chunked_prefill_extends_its_own_path() -> None:
    kv = KVCacheManager(num_pages=16, page_size=PS)
    req = make_request("a", list(range(100, 116)))
    kv.admit(req)
    for step in range(1, 5):
        compute(kv, req, PS)
        assert kv.tree is not None and kv.tree.num_pages == step
        assert kv.tree.match_prefix(req.prompt_token_ids, touch=False).page_ids == req.page_ids[:step]
        assert kv.tree.num_locked == step  # the request keeps its whole path locked
        kv.integrity_check()
    other = make_request("b", req.prompt_token_ids + [1])
    assert kv.admit(other) == 16  # hits the running request's pages while it still runs
    assert other.page_ids == req.page_ids
    kv.integrity_check()


def test_generated_tokens_are_cached_for_the_next_turn() -> None:
    kv = KVCacheManager(num_pages=16, page_size=PS)
    turn1 = make_request("t1", [1, 2, 3, 4, 5, 6])
    serve_prompt(kv, turn1)
    for token in [7, 8, 9]:  # decode: sample, then compute the sampled token's KV next step
        turn1.output_token_ids.append(token)
        compute(kv, turn1, 1)
    kv.free(turn1)
    turn2 = make_request("t2", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert kv.admit(turn2) == 9  # the answer's tokens 7 and 8 complete page 2; 9 is page 3's tail
    kv.integrity_check()


def test_the_next_turn_claims_the_partial_last_page_and_continues_it() -> None:
    kv = KVCacheManager(num_pages=16, page_size=PS)
    turn1 = make_request("t1", list(range(1, 11)))  # 10 tokens: 2 full pages and 2 tokens of a third
    serve_prompt(kv, turn1)
    partial = turn1.page_ids[2]
    kv.free(turn1)
    assert kv.tree is not None and kv.tree.num_pages == 2
    assert kv.num_evictable_pages == 3 and kv.usage() == 0.0  # the tail's page is cached capacity too
    kv.integrity_check()

    turn2 = make_request("t2", list(range(1, 11)) + [50, 51, 52])
    assert kv.admit(turn2) == 10 and turn2.num_cached_tokens == 10
    assert turn2.page_ids[2] == partial  # the page is now turn2's own: it writes tokens 11-12 into it
    assert kv.num_evictable_pages == 0
    compute(kv, turn2, 3)
    assert kv.tree.num_pages == 3  # the claimed page filled up and joined the tree
    kv.integrity_check()


def test_a_tail_serves_only_prompts_that_continue_it() -> None:
    kv = KVCacheManager(num_pages=16, page_size=PS)
    serve_prompt(kv, first := make_request("a", [1, 2, 3, 4, 5, 6, 7]))  # tail: 5, 6, 7
    kv.free(first)
    other = make_request("b", [1, 2, 3, 4, 9, 9, 9, 9])
    assert kv.admit(other) == 4  # diverges at the tail's first token: whole pages only
    partly = make_request("c", [1, 2, 3, 4, 5, 6, 0, 0])
    assert kv.admit(partly) == 6  # shares two of the tail's three tokens
    salted = make_request("d", [1, 2, 3, 4, 5, 6, 7, 8], salt="x")
    assert kv.admit(salted) == 0
    kv.integrity_check()


def test_tails_are_evicted_first_and_preempted_requests_get_theirs_back() -> None:
    kv = KVCacheManager(num_pages=6, page_size=PS)  # 5 usable pages
    done = make_request("done", [1] * 6)  # one full page and a tail of two
    serve_prompt(kv, done)
    kv.free(done)
    assert kv.allocator.num_free == 3 and kv.num_free_pages == 5
    big = make_request("big", [2] * 16)
    kv.admit(big)
    assert kv.allocate(big, 16)  # four pages: the free three and the tail's, the full page stays cached
    assert kv.num_evicted_pages == 1 and kv.tree is not None and kv.tree.num_pages == 1
    big.num_computed_tokens = 10  # preempted after 10 of its tokens
    kv.free(big)
    kv.integrity_check()
    big.num_computed_tokens = 0
    assert kv.admit(big) == 10  # two full pages from the tree, the tail of two
    assert kv.reset_prefix_cache() == 1  # only "done"'s page: big's pages are held again
    kv.integrity_check()


def test_allocate_evicts_unlocked_pages_and_refuses_when_only_locked_ones_remain() -> None:
    kv = KVCacheManager(num_pages=5, page_size=PS)  # 4 usable pages
    old = make_request("old", list(range(1, 13)))  # 3 pages
    serve_prompt(kv, old)
    kv.free(old)
    assert kv.allocator.num_free == 1 and kv.num_free_pages == 4
    new = make_request("new", [50] * 16)
    kv.admit(new)
    assert kv.allocate(new, 16)  # needs 4 pages: evicts all 3 cached ones
    assert kv.num_evicted_pages == 3 and kv.usage() == 1.0
    blocked = make_request("blocked", [60] * 4)
    kv.admit(blocked)
    assert not kv.allocate(blocked, 4)
    assert blocked.page_ids == []
    kv.cancel_admission(blocked)
    kv.integrity_check()


def test_two_requests_computing_the_same_block_end_up_sharing_one_page() -> None:
    kv = KVCacheManager(num_pages=16, page_size=PS)
    a, b = make_request("a", [9] * 8 + [1]), make_request("b", [9] * 8 + [2])
    kv.admit(a)
    kv.admit(b)  # both miss: neither has computed anything yet
    assert kv.allocate(a, 9) and kv.allocate(b, 9)
    a.num_computed_tokens = b.num_computed_tokens = 9
    kv.cache_full_pages(a)
    free_before = kv.allocator.num_free
    kv.cache_full_pages(b)  # b's two full pages duplicate a's: b switches to a's pages
    assert b.page_ids[:2] == a.page_ids[:2] and b.page_ids[2] != a.page_ids[2]
    assert kv.allocator.num_free == free_before + 2
    kv.integrity_check()
    kv.free(a)
    kv.free(b)
    assert kv.usage() == 0.0
    kv.integrity_check()


def test_salted_requests_never_hit_each_others_pages() -> None:
    kv = KVCacheManager(num_pages=16, page_size=PS)
    prompt = list(range(1, 14))
    serve_prompt(kv, make_request("a", prompt, salt="alice"))
    assert kv.admit(make_request("b", prompt, salt="bob")) == 0
    assert kv.admit(make_request("c", prompt)) == 0
    assert kv.admit(make_request("d", prompt, salt="alice")) == 12
    kv.integrity_check()


def test_cancel_admission_undoes_counters_and_locks() -> None:
    kv = KVCacheManager(num_pages=16, page_size=PS)
    prompt = list(range(1, 10))
    serve_prompt(kv, make_request("a", prompt))
    queried, hits = kv.num_queried_tokens, kv.num_hit_tokens
    req = make_request("b", prompt)
    kv.admit(req)
    kv.cancel_admission(req)
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (queried, hits)
    assert req.num_cached_tokens is None and req.num_computed_tokens == 0 and req.page_ids == []
    assert kv.tree is not None and kv.tree.num_locked == 2  # only "a" (still held) locks its two full pages
    kv.integrity_check()


def test_without_prefix_caching_pages_go_straight_back_to_the_free_list() -> None:
    kv = KVCacheManager(num_pages=8, page_size=PS, enable_prefix_caching=False)
    prompt = list(range(1, 10))
    for rid in "ab":
        req = make_request(rid, prompt)
        assert kv.admit(req) == 0
        compute(kv, req, 9)
        assert kv.usage() == 3 / 7
        kv.free(req)
        assert kv.allocator.num_free == 7
    assert kv.num_queried_tokens == 0 and kv.num_hit_tokens == 0
    assert kv.reset_prefix_cache() == 0
    kv.integrity_check()


def test_reset_prefix_cache_drops_only_unlocked_pages() -> None:
    kv = KVCacheManager(num_pages=16, page_size=PS)
    done = make_request("done", [1] * 8)
    serve_prompt(kv, done)
    kv.free(done)
    running = make_request("running", [2] * 9)
    serve_prompt(kv, running)
    assert kv.reset_prefix_cache() == 2
    assert kv.tree is not None and kv.tree.num_pages == 2
    kv.integrity_check()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_pages=st.integers(4, 24))
def test_every_cached_token_a_request_is_given_is_its_own_token(seed: int, num_pages: int) -> None:
    """Random conversations (each turn resends the history plus new tokens), preemptions and aborts under page
    pressure: whatever admit hands a request, whole pages or a claimed tail, holds KV of exactly that
    request's tokens at those positions, and no page leaks."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_pages=num_pages, page_size=PS)
    written: dict[int, dict[int, int]] = {}  # page -> slot -> the token whose KV a step wrote there
    histories: list[list[int]] = [[rng.randrange(3)] for _ in range(3)]
    for n in range(40):
        conv = rng.randrange(len(histories))
        prompt = histories[conv] + [rng.randrange(3) for _ in range(rng.randrange(1, 7))]
        req = make_request(f"r{n}", prompt)
        hit = kv.admit(req)
        for pos in range(hit):
            assert written[req.page_ids[pos // PS]][pos % PS] == req.all_token_ids[pos]
        while req.num_computed_tokens < req.num_tokens and rng.random() > 0.05:
            step = min(rng.randrange(1, 6), req.num_tokens - req.num_computed_tokens)
            if not kv.allocate(req, step):
                break  # no room: this request gives up (a preemption that never comes back)
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + step):
                written.setdefault(req.page_ids[pos // PS], {})[pos % PS] = req.all_token_ids[pos]
            req.num_computed_tokens += step
            kv.cache_full_pages(req)
            if req.num_computed_tokens == req.num_tokens and len(req.output_token_ids) < 3:
                req.output_token_ids.append(rng.randrange(3))  # a decode: its KV comes with the next step
        histories[conv] = req.all_token_ids
        kv.free(req)
        kv.integrity_check()
    assert kv.num_used_pages == 0
