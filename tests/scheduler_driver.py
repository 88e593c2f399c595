"""A fake paged model and a minimal engine loop for driving the scheduler in tests, no JAX.

The fake model stores token ids as its "KV": it writes each step's tokens through `slot_mapping` and reads
each sequence's context back through its page table, checks that the context is the request's tokens (so a
wrong page, a stale cached page or a page freed too early shows up), and samples a token that depends on the
whole context. Outputs therefore do not depend on batching, chunking, caching or preemption.

With `async_scheduling` the driver runs the engine's asynchronous loop: step k is scheduled and run before
step k-1's tokens reach the scheduler, its decodes carrying placeholders (`core.batch.placeholder`) that the fake
model resolves from step k-1's samples, as the real forward does on the device.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.batch import RaggedBatch, is_placeholder, placeholder_seq
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.stops import check_token_stop
from jaxserve.scheduler.kv_cache_manager import KVCacheManager
from jaxserve.scheduler.scheduler import Scheduler, SchedulerConfig

VOCAB = 50


class FakeModel:
    """A paged 'model' whose KV is the token ids themselves."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.kv = np.full(num_pages * page_size, -1, dtype=np.int64)

    def step(self, batch: RaggedBatch, prev: np.ndarray | None = None) -> np.ndarray:
        """Write the batch's tokens, check every context, sample. `prev`: the previous step's samples, which
        placeholder ids stand for."""
        def resolve(ids: np.ndarray) -> np.ndarray:
            ids = np.asarray(ids, dtype=np.int64)
            if is_placeholder(ids).any():
                assert prev is not None, "a placeholder without a step in flight"
                ids = np.where(is_placeholder(ids), prev[np.maximum(placeholder_seq(ids), 0)], ids)
            return ids

        self.kv[batch.slot_mapping] = resolve(batch.token_ids)
        sampled = np.zeros(batch.num_seqs, dtype=np.int64)
        for s, req in enumerate(batch.requests):
            n = int(batch.kv_lens[s])
            pages = batch.page_table[s, : -(-n // self.page_size)]
            slots = (pages[:, None] * self.page_size + np.arange(self.page_size)).ravel()[:n]
            context = self.kv[slots]
            assert context.tolist() == resolve(req.all_token_ids[:n]).tolist(), f"{req.request_id} reads wrong KV"
            sampled[s] = int((context * np.arange(1, n + 1)).sum() % 7919) % VOCAB + 1
        return sampled


def make_scheduler(num_pages: int = 64, **overrides) -> Scheduler:
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=32, page_size=4, max_model_len=512)
    config = SchedulerConfig(**{**defaults, **overrides})
    return Scheduler(config, KVCacheManager(num_pages, config.page_size, config.enable_prefix_caching))


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(prompt), params, arrival_time=0.0, max_tokens=max_tokens, cache_salt=salt)


def check_batch(batch: RaggedBatch, config: SchedulerConfig) -> None:
    """Everything a step may rely on: budgets, decodes first, chunk sizes, page-aligned chunk ends."""
    q_lens = np.diff(batch.cu_q_lens)
    assert batch.num_tokens <= config.max_num_batched_tokens
    assert batch.num_seqs <= config.max_num_seqs
    assert (q_lens >= 1).all()
    assert len({r.request_id for r in batch.requests}) == batch.num_seqs
    assert (q_lens[: batch.num_decodes] == 1).all() and batch.samples[: batch.num_decodes].all()
    for s in range(batch.num_decodes, batch.num_seqs):
        assert q_lens[s] <= config.chunk_size
        # a chunk that does not finish its prompt ends on a page boundary, unless not even a page fitted
        aligned = batch.kv_lens[s] % config.page_size == 0
        assert batch.samples[s] or aligned or q_lens[s] < config.page_size, "chunk ends mid-page"


class Driver:
    """A minimal engine loop: schedule, run the fake model, update, stop on max_tokens."""

    def __init__(self, scheduler: Scheduler, num_pages: int, async_scheduling: bool = False) -> None:
        self.scheduler = scheduler
        self.model = FakeModel(num_pages, scheduler.config.page_size)
        self.finished: dict[str, Request] = {}
        self.batches: list[RaggedBatch] = []
        self.async_scheduling = async_scheduling
        self.flight: tuple[np.ndarray, list] | None = None  # (samples, placeholders) of the step in flight

    def _finish_stopped(self, req: Request) -> None:
        status = check_token_stop(req, self.scheduler.config.max_model_len)
        if status is not None:
            self.scheduler.finish_request(req, status)
            self.finished[req.request_id] = req

    def step(self) -> RaggedBatch | None:
        if self.async_scheduling:
            return self._step_async()
        sched = self.scheduler
        batch = sched.schedule()
        sched.integrity_check()
        if batch is None:
            return None
        check_batch(batch, sched.config)
        self.batches.append(batch)
        for req in sched.update_after_step(batch, self.model.step(batch)):
            self._finish_stopped(req)
        sched.integrity_check()
        return batch

    def _step_async(self) -> RaggedBatch | None:
        """Schedule and run step k, then hand step k-1's tokens to the scheduler, then advance step k."""
        sched = self.scheduler
        batch = sched.schedule()
        sched.integrity_check()
        sampled = None
        if batch is not None:
            check_batch(batch, sched.config)
            self.batches.append(batch)
            sampled = self.model.step(batch, self.flight[0] if self.flight else None)
        if self.flight is not None:
            prev, placeholders = self.flight
            for req, index, s in placeholders:
                req.output_token_ids[index] = int(prev[s])
            for req, _, _ in placeholders:
                if not req.status.finished:
                    self._finish_stopped(req)
        self.flight = None if batch is None else (sampled, sched.advance_after_dispatch(batch))
        sched.integrity_check()
        return batch

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work() and self.flight is None:
                return
            self.step()
        raise AssertionError("the scheduler did not drain its work: livelock or deadlock")


def outputs_of(requests: list[Request], **config) -> dict[str, list[int]]:
    """Serve fresh copies of `requests` to completion and return each one's generated tokens."""
    num_pages = config.pop("num_pages", 64)
    async_scheduling = config.pop("async_scheduling", False)
    driver = Driver(make_scheduler(num_pages, **config), num_pages, async_scheduling)
    for r in requests:
        driver.scheduler.add_request(make_request(r.request_id, r.prompt_token_ids, r.max_tokens, r.cache_salt))
    driver.run()
    assert driver.scheduler.kv.usage() == 0.0
    return {rid: r.output_token_ids for rid, r in driver.finished.items()}
