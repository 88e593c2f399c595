"""Continuous batching with chunked prefill, prefix-cache admission and preemption by recompute.

Every request owes tokens: a decode owes one, a prompt being prefilled owes the rest of its prompt (sent in
chunks of at most `chunk_size` that end on page boundaries, so each chunk completes whole pages for the
cache). Each `schedule()` call fills one step under the token budget (`max_num_batched_tokens`) and
`max_num_seqs`: running decodes first, then running prefill chunks, then waiting requests, oldest first (or
longest cached prefix first with policy "lpm"). When pages run out, the most recently admitted running request
is preempted: its computed pages go to the prefix cache, it forgets its progress and goes back to the front of
the queue, to be recomputed (cheaply, from the cache) later.

Admission keeps room for decode growth (SGLang's new-token ratio): a waiting request is admitted only if the
free pages cover its own prompt and a `new_token_ratio` share of the outputs still to come for it and for every
running request. The ratio decays from 0.7 towards 0.1 over steps and jumps back up on preemption, so
preemption stays rare. A lone request always runs: `add_request` rejects any request that could not fit in
the whole pool or in `max_model_len`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxserve.core.batch import RaggedBatch, build_ragged_batch, placeholder
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.validation import resolve_max_tokens
from jaxserve.scheduler.kv_cache_manager import KVCacheManager

POLICIES = ("fcfs", "lpm")


@dataclass
class SchedulerConfig:
    """Budgets and policies of the scheduler (sizes in tokens unless named otherwise)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunk_size: int = 512  # most prompt tokens one request prefills in one step
    page_size: int = 16
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # "fcfs" or "lpm" (longest cached prefix first, FCFS beyond lpm_max_queue)
    lpm_max_queue: int = 128
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay_steps: int = 600  # steps to decay from init to min
    reserve_max_new_tokens: int = 4096  # clip each request's expected outputs in the reservation

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "page_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")


@dataclass
class SchedulerStats:
    """The scheduler's share of a StepStats: queue sizes, KV usage, and what the last schedule() did."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int  # in the last schedule() call
    prefix_queries: int  # prompt tokens looked up in the last schedule() call
    prefix_hits: int  # of those, served from the cache


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        if kv_cache_manager.page_size != config.page_size:
            raise ValueError(f"page_size {config.page_size} != KV manager's {kv_cache_manager.page_size}")
        if kv_cache_manager.enable_prefix_caching != config.enable_prefix_caching:
            raise ValueError("enable_prefix_caching differs between the config and the KV manager")
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.new_token_ratio = config.init_new_token_ratio
        self._ratio_decay = (config.init_new_token_ratio - config.min_new_token_ratio) / max(
            1, config.new_token_ratio_decay_steps)
        self.num_preemptions = 0  # over the scheduler's life
        self._step_preemptions = 0
        self._step_queries = 0
        self._step_hits = 0

    # ---- queue -------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def add_request(self, req: Request) -> None:
        """Queue a request; ValueError if its id is in use or it could never fit."""
        cfg = self.config
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        n = req.num_prompt_tokens
        resolve_max_tokens(n, req.max_tokens, cfg.max_model_len)
        total = n + req.max_tokens
        pages = self.kv.pages_for(total - 1)  # the last sampled token's KV is never computed
        if pages > self.kv.num_usable_pages:
            raise ValueError(f"request {req.request_id}: prompt ({n} tokens) + max_tokens ({req.max_tokens}) "
                             f"needs {pages} KV pages of {cfg.page_size} tokens, but the whole KV pool has "
                             f"{self.kv.num_usable_pages}")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    # ---- one step ----------------------------------------------------------------------------------

    def schedule(self) -> RaggedBatch | None:
        """Pick this step's work; None when there is nothing to run."""
        queried0, hits0 = self.kv.num_queried_tokens, self.kv.num_hit_tokens
        self._step_preemptions = 0
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, tuple[Request, int]] = {}

        decoding = [r for r in self.running if r.num_tokens_owed == 1]
        prefilling = [r for r in self.running if r.num_tokens_owed > 1]
        for req in decoding + prefilling:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING or self._out_of_length(req):  # preempted in this loop, or
                continue  # (asynchronous scheduling) about to finish on the length its last draw reached
            n = self._num_new_tokens(req, budget)
            if n == 0:
                continue
            n += self._num_drafts(req, n, budget)
            while not self.kv.allocate(req, n):
                victim = self.running[-1]
                budget += self._preempt(victim, scheduled)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = (req, n)
                budget -= n

        if not self._step_preemptions or not scheduled:
            budget = self._admit_waiting(budget, scheduled)

        self._step_queries = self.kv.num_queried_tokens - queried0
        self._step_hits = self.kv.num_hit_tokens - hits0
        self.new_token_ratio = max(self.config.min_new_token_ratio, self.new_token_ratio - self._ratio_decay)
        if not scheduled:
            return None
        items = list(scheduled.values())
        decodes = [(r, n) for r, n in items if n == 1 and r.num_tokens_owed == 1]
        prefills = [(r, n) for r, n in items if not (n == 1 and r.num_tokens_owed == 1)]
        return build_ragged_batch(decodes + prefills, len(decodes), self.config.page_size)

    def schedule_decode_run(self, k: int) -> tuple[RaggedBatch, list[int]] | None:
        """Every running request decodes and none waits: a decode-only batch whose sequences may draw up to `k`
        tokens each in one dispatch, with their pages reserved, and each one's limit (at most k, within
        max_tokens and max_model_len). None (nothing reserved beyond what a step would use) when that is not
        the case or the pages are short; the caller then runs `schedule()`."""
        if k < 2 or self.waiting or not self.running or any(r.num_tokens_owed != 1 for r in self.running):
            return None
        cfg = self.config
        limits = [min(k, r.max_tokens - len(r.output_token_ids), cfg.max_model_len - r.num_tokens)
                  for r in self.running]
        if min(limits) < 1 or len(self.running) > cfg.max_num_batched_tokens:
            return None
        if not all(self.kv.allocate(r, n) for r, n in zip(self.running, limits, strict=True)):
            return None
        self._step_preemptions = self._step_queries = self._step_hits = 0
        batch = build_ragged_batch([(r, 1) for r in self.running], len(self.running), cfg.page_size)
        return batch, limits

    def clear_step_stats(self) -> None:
        """Zero the last schedule() call's preemptions and prefix lookups: a step ran without calling it (a chained
        speculative round), so `stats()` must not count that call's again."""
        self._step_preemptions = self._step_queries = self._step_hits = 0

    def record_token(self, req: Request, token_id: int) -> None:
        """One token a decode run drew for `req`: the KV of its input (the last token) is now computed."""
        req.num_computed_tokens = req.num_tokens
        req.output_token_ids.append(int(token_id))
        self.kv.cache_full_pages(req)

    def _num_drafts(self, req: Request, n: int, budget: int) -> int:
        """Proposed tokens (speculative decoding) a decode verifies beside its own: its `spec_token_ids` cut to the
        budget and to pages that leave one free page per running request (speculation never preempts)."""
        if not req.spec_token_ids or n != 1 or req.num_tokens_owed != 1:
            return 0
        k = min(len(req.spec_token_ids), budget - n)
        spare = self.kv.num_free_pages - len(self.running)
        while k > 0 and self.kv.pages_for(req.num_tokens + k) - len(req.page_ids) > spare:
            k -= 1
        del req.spec_token_ids[max(k, 0):]
        return max(k, 0)

    def _out_of_length(self, req: Request) -> bool:
        return len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.config.max_model_len

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens `req` computes this step: all it owes, or a chunk ending on a page boundary.

        When not even the rest of one page fits (budget remainder, or chunk_size < page_size), the chunk is
        what fits, so a prefill always progresses; the next chunk then realigns to a page boundary.
        """
        start = req.num_computed_tokens
        owed = req.num_tokens - start
        n = min(owed, self.config.chunk_size, budget)
        if n < owed:
            ps = self.config.page_size
            aligned = (start + n) // ps * ps - start
            if aligned > 0:
                n = aligned
        return max(n, 0)

    def _admit_waiting(self, budget: int, scheduled: dict[str, tuple[Request, int]]) -> int:
        """Move waiting requests to running while budgets, pages and the growth reservation allow."""
        cfg = self.config
        if budget <= 0 or not self.waiting or len(self.running) >= cfg.max_num_seqs:
            return budget
        reserved = sum(self._growth_pages(r) for r in self.running)
        for req in self._waiting_order():
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                break
            self.kv.admit(req)
            n = self._num_new_tokens(req, budget)
            growth = self._growth_pages(req)
            fits = n > 0 and (not self.running or reserved + growth <= self.kv.num_free_pages)
            if not fits or not self.kv.allocate(req, n):
                self.kv.cancel_admission(req)
                break
            reserved += self._growth_pages(req)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = (req, n)
            budget -= n
        return budget

    def _growth_pages(self, req: Request) -> int:
        """Pages `req` is expected to need beyond what it holds: its whole prompt plus ratio x future outputs."""
        future = min(req.max_tokens - len(req.output_token_ids), self.config.reserve_max_new_tokens)
        expected = req.num_tokens + math.ceil(self.new_token_ratio * max(future, 0))
        cap = req.num_prompt_tokens + req.max_tokens - 1
        return max(0, self.kv.pages_for(min(expected, cap)) - len(req.page_ids))

    def _waiting_order(self) -> list[Request]:
        """FCFS, or with policy "lpm" preempted requests then longest cached prefix first."""
        tree = self.kv.tree
        if self.config.policy == "fcfs" or tree is None or len(self.waiting) > self.config.lpm_max_queue:
            return list(self.waiting)

        def key(item: tuple[int, Request]) -> tuple[bool, int, int]:
            i, r = item
            hit = tree.match_prefix(r.all_token_ids[: r.num_tokens - 1], r.cache_salt, touch=False)
            return (r.num_preemptions == 0, -len(hit.page_ids), i)

        return [r for _, r in sorted(enumerate(self.waiting), key=key)]

    def _preempt(self, victim: Request, scheduled: dict[str, tuple[Request, int]]) -> int:
        """Preempt by recompute; return the tokens it had been given this step (refunded to the budget)."""
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        self._step_preemptions += 1
        self.new_token_ratio = self.config.init_new_token_ratio
        _, refund = scheduled.pop(victim.request_id, (victim, 0))
        return refund

    def update_after_step(self, batch: RaggedBatch, sampled_token_ids: Sequence[int] | np.ndarray) -> list[Request]:
        """Record a finished step: advance computed tokens, append samples, cache newly full pages.

        `sampled_token_ids` has one entry per sequence of the batch (entries of sequences whose `samples`
        flag is off are ignored). Requests finished or aborted meanwhile are skipped. Returns the requests
        that got a new token, in batch order; the engine checks their stop conditions.
        """
        sampled: list[Request] = []
        for s, req in enumerate(batch.requests):
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens = int(batch.kv_lens[s])
            if batch.samples[s]:
                req.output_token_ids.append(int(sampled_token_ids[s]))
                sampled.append(req)
            self.kv.cache_full_pages(req)
        return sampled

    def advance_after_dispatch(self, batch: RaggedBatch) -> list[tuple[Request, int, int]]:
        """Record a dispatched step before its tokens are known (asynchronous scheduling).

        Like `update_after_step`, but each drawing sequence s gets the placeholder token `placeholder(s)`, which the
        next step's forward replaces on the device with what s drew. Returns (request, index into its
        output_token_ids, s) for each placeholder; the engine writes the real tokens there once the step is
        collected, before advancing the next step. A placeholder is always the last token, whose KV is not yet
        computed, so no cached page ever holds one.
        """
        placeholders: list[tuple[Request, int, int]] = []
        for s, req in enumerate(batch.requests):
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens = int(batch.kv_lens[s])
            if batch.samples[s]:
                placeholders.append((req, len(req.output_token_ids), s))
                req.output_token_ids.append(placeholder(s))
            self.kv.cache_full_pages(req)
        return placeholders

    # ---- leaving ----------------------------------------------------------------------------------

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Remove a waiting or running request and release its pages now (its full pages stay cached)."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        if self.requests.get(req.request_id) is not req:
            return  # already finished
        del self.requests[req.request_id]
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request; False if it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return True

    # ---- reporting ---------------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        """Current queue sizes and KV usage, with the last schedule() call's preemptions and prefix lookups."""
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              kv_usage=self.kv.usage(), num_preemptions=self._step_preemptions,
                              prefix_queries=self._step_queries, prefix_hits=self._step_hits)

    def integrity_check(self) -> None:
        """Assert the queues, the request table and the KV pages agree (cheap enough for every step)."""
        self.kv.integrity_check()
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        assert len(running_ids) == len(self.running), "a request is running twice"
        assert len(waiting_ids) == len(self.waiting), "a request is waiting twice"
        assert not running_ids & waiting_ids, "a request is both running and waiting"
        assert running_ids | waiting_ids == set(self.requests), "request table and queues disagree"
        assert len(self.running) <= self.config.max_num_seqs, "more running requests than max_num_seqs"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, f"{r.request_id} is in running with status {r.status}"
            assert self.kv.holds(r), f"running request {r.request_id} holds no KV"
            assert len(r.page_ids) >= self.kv.pages_for(r.num_computed_tokens), f"{r.request_id} lacks pages"
        for r in self.waiting:
            assert r.status == RequestStatus.WAITING, f"{r.request_id} is waiting with status {r.status}"
            assert not self.kv.holds(r) and not r.page_ids, f"waiting request {r.request_id} holds pages"
            assert r.num_computed_tokens == 0, f"waiting request {r.request_id} has computed tokens"
