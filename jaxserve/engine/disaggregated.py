"""Disaggregated serving: a prefill pool and a decode pool on two device groups of one process.

The prefill pool (the first `prefill_devices` devices, TP = that count) runs prompts only, with chunked prefill
and prefix caching. When a prompt's last chunk has run and its first token is drawn, the request's KV pages are
gathered into one block (unique KV heads only, so replication for TP is never shipped), its prefill pages are
released (full ones stay in the prefix cache), and the block waits in a bounded queue. When the decode pool
(the next `decode_devices` devices) has room, the block is `device_put` onto the decode group's sharding and
written into freshly allocated pages by a donated update; the request then decodes there like any other.

Back-pressure: while `max_pending_transfers` blocks wait, no new prefill step starts, so prompts queue in the
prefill scheduler. TTFT includes the transfer: the first token is emitted once its KV is in the decode pool.
A prefill step stays in flight while decode steps run (the two pools compute concurrently) and is collected
when it is done. Decode-side preemption falls back to recompute on the decode pool. Each pool's busy time and
work (prompts prefilled, output tokens decoded) are counted per step (`jaxserve.engine.pool_stats`), so the P:D balance
the planner predicts can be measured.

`DisaggregatedEngine` is an `LLMEngine` (the decode pool plus request tracking, stop checks and outputs), so
`LLM` and `AsyncEngine` drive it unchanged; `jaxserve.engine.factory.create_engine` picks it when
`config.disaggregate` is set.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.core.batch import RaggedBatch
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.request import Request, RequestStatus
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.pool_stats import POOL_COUNTERS, PoolStep, ReadyStamp, pool_rates
from jaxserve.runner.model_runner import power_of_two_ladder
from jaxserve.runner.sampler import SamplingArrays
from jaxserve.scheduler.scheduler import Scheduler


@dataclass
class KVTransfer:
    """One request's move from the prefill pool to the decode pool."""

    request_id: str
    num_tokens: int  # tokens whose KV moved (the prompt)
    num_bytes: int  # KV bytes of those tokens in the shipped block (all layers, unique KV heads)
    block_bytes: int  # bytes of the shipped block (whole pages, padded to a page-count bucket)
    seconds: float  # device_put + insert, until the decode pool holds the pages


@dataclass
class _Handoff:
    req: Request
    block: jax.Array  # on the prefill devices
    num_tokens: int


@dataclass
class _InFlight:
    batch: RaggedBatch
    sampling: SamplingArrays
    pending: Any
    start: float  # perf_counter when the step was scheduled
    ready: ReadyStamp  # when its outputs became ready on the prefill devices


class _DecodeScheduler(Scheduler):
    """The decode pool's scheduler: new requests go to the prefill pool; prefilled ones arrive with their KV."""

    def __init__(self, base: Scheduler, engine: DisaggregatedEngine) -> None:
        super().__init__(base.config, base.kv)
        self.engine = engine

    def add_request(self, req: Request) -> None:
        super().add_request(req)  # the decode pool's checks (context length, whole-pool fit)
        self.waiting.pop()
        del self.requests[req.request_id]
        self.engine.prefill.scheduler.add_request(req)

    def abort_request(self, request_id: str) -> bool:
        if request_id in self.requests:
            return super().abort_request(request_id)
        return self.engine.abort_upstream(request_id)

    def add_prefilled(self, req: Request, num_tokens: int) -> bool:
        """Admit a request whose first `num_tokens` tokens of KV are about to be inserted; False if no room.

        Room means a sequence slot, pages for those tokens, and the same growth reservation as admission from
        the waiting queue (a lone request always fits).
        """
        if len(self.running) >= self.config.max_num_seqs:
            return False
        req.page_ids, req.num_computed_tokens = [], 0
        reserved = sum(self._growth_pages(r) for r in self.running)
        if self.running and self.kv.pages_for(num_tokens + 1) + reserved > self.kv.num_free_pages:
            return False
        if not self.kv.allocate(req, num_tokens):
            return False
        req.num_computed_tokens = num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.requests[req.request_id] = req
        return True


class _PrefillScheduler(Scheduler):
    """The prefill pool's scheduler: a request leaves after its first token, so admission reserves no decode growth."""

    def _growth_pages(self, req: Request) -> int:
        return max(0, self.kv.pages_for(req.num_prompt_tokens) - len(req.page_ids))


class DisaggregatedEngine(LLMEngine):
    """Prefill on one device group, decode on another, KV moved between them (see module doc)."""

    supports_prompt_logprobs = False  # the prefill pool's steps keep no prompt rows

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        p, d = config.prefill_devices, config.decode_devices
        if len(jax.devices()) < p + d:
            raise ValueError(f"disaggregation over {p} prefill + {d} decode devices needs {p + d} devices; "
                             f"{len(jax.devices())} visible")
        base = dataclasses.replace(config, disaggregate=False, device_ids=())
        prefill_config = dataclasses.replace(base, tensor_parallel_size=p, device_ids=tuple(range(p)))
        decode_config = dataclasses.replace(base, tensor_parallel_size=d, device_ids=tuple(range(p, p + d)),
                                            enable_prefix_caching=False)
        self.prefill = LLMEngine(prefill_config, clock)
        self.prefill.scheduler = _PrefillScheduler(self.prefill.scheduler.config, self.prefill.kv_manager)
        super().__init__(decode_config, clock)
        self.disagg_config = config
        self.max_model_len = min(self.max_model_len, self.prefill.max_model_len)
        self.scheduler = _DecodeScheduler(self.scheduler, self)
        self._pending: deque[_Handoff] = deque()
        self._inflight: _InFlight | None = None
        self.transfers: deque[KVTransfer] = deque(maxlen=4096)
        # Each pool's recent steps (busy interval and shape): how much the pools ran at the same time, and how fast.
        self.pool_steps: dict[str, deque[PoolStep]] = {"prefill": deque(maxlen=4096), "decode": deque(maxlen=4096)}
        # One page-count ladder for both pools, so every block the prefill pool gathers was warmed for insertion.
        ladder = power_of_two_ladder(-(-self.max_model_len // config.page_size))
        self.prefill.runner.page_buckets = self.runner.page_buckets = ladder
        self.counters.update(kv_transfers=0, kv_transfer_bytes=0, kv_transfer_block_bytes=0,
                             kv_transfer_seconds=0.0, **POOL_COUNTERS)
        if config.warmup:
            self.prefill.runner.warmup_transfer(self.spec.num_kv_heads, insert=False)
            self.runner.warmup_transfer(self.spec.num_kv_heads, gather=False)

    # Requests that have not reached the decode pool --------------------------------------------------------
    def abort_upstream(self, request_id: str) -> bool:
        """Drop a request that is still in the prefill pool or waiting for transfer."""
        if self.prefill.scheduler.abort_request(request_id):
            return True
        for h in self._pending:
            if h.req.request_id == request_id:
                self._pending.remove(h)
                return True
        return False

    # The loop body -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Move prefilled requests into the decode pool, keep a prefill step in flight, run one decode step."""
        outputs = self._transfer_ready()
        if self._inflight is None:
            self._dispatch_prefill()
        decode_busy = self.scheduler.has_work()
        if decode_busy:
            outputs += self._decode_step()
        if self._inflight is not None and (not decode_busy or self.prefill.runner.is_ready(self._inflight.pending)):
            outputs += self._collect_prefill()
            if not decode_busy:
                outputs += self._transfer_ready()
        return outputs

    def _decode_step(self) -> list[RequestOutput]:
        """One decode-pool step (`LLMEngine.step`), with its busy time and work in the pool counters."""
        c = self.counters
        steps, tokens, start = c["steps"], c["generation_tokens"], time.perf_counter()
        outputs = super().step()
        if c["steps"] > steps:
            end = time.perf_counter()
            self.pool_steps["decode"].append(PoolStep.of_stats(start, end, self.last_step))
            c["decode_busy_seconds"] += end - start
            c["decode_steps"] += 1
            c["decode_output_tokens"] += c["generation_tokens"] - tokens
            c["decode_batch_seqs"] += self.last_step.num_decode_tokens + len(self.last_step.prefill_chunks)
        return outputs

    def _dispatch_prefill(self) -> None:
        if len(self._pending) >= self.disagg_config.max_pending_transfers:
            return  # back-pressure: the decode pool is behind
        start = time.perf_counter()
        sched = self.prefill.scheduler
        batch = sched.schedule()
        stats = sched.stats()
        self.counters["prefix_cache_queries"] += stats.prefix_queries
        self.counters["prefix_cache_hits"] += stats.prefix_hits
        self.counters["num_preemptions"] += stats.num_preemptions
        if batch is None:
            return
        sampling = self._sampling_for(batch, self.prefill.runner)
        pending = self.prefill.runner.dispatch(batch, sampling)
        self._inflight = _InFlight(batch, sampling, pending, start, ReadyStamp(pending))

    def _collect_prefill(self) -> list[RequestOutput]:
        """Finish the in-flight prefill step: gather each completed prompt's KV and release its prefill pages."""
        flight, self._inflight = self._inflight, None
        batch, sched, runner = flight.batch, self.prefill.scheduler, self.prefill.runner
        result = runner.collect(flight.pending, batch, flight.sampling)
        ready = flight.ready.ready_at()
        self.pool_steps["prefill"].append(PoolStep.of_batch(flight.start, ready, batch))
        self.counters["prefill_busy_seconds"] += ready - flight.start
        self.counters["prefill_steps"] += 1
        self.counters["prefill_prompt_tokens"] += batch.num_prefill_tokens
        sched.update_after_step(batch, np.where(batch.samples, result.tokens, -1))
        outputs = []
        now = self.clock()
        for s, req in enumerate(batch.requests):
            if not batch.samples[s] or req.status != RequestStatus.RUNNING:
                continue
            tracked = self._tracked[req.request_id]
            self.counters["generation_tokens"] += 1
            self.counters["prefill_prompts"] += 1
            if tracked.logprobs is not None:
                tracked.logprobs.append(self._logprob_entry(result, s, req.sampling_params.logprobs or 0))
            n = req.num_computed_tokens
            block = runner.gather_pages(req.page_ids[: sched.kv.pages_for(n)], self.spec.num_kv_heads)
            sched.finish_request(req, RequestStatus.FINISHED_LENGTH)  # full pages stay in the prefix cache
            req.status = RequestStatus.WAITING
            finish = tracked.stops.check(req)
            if finish is None:
                self._pending.append(_Handoff(req, block, n))
                continue
            status, reason = finish  # the first token ends it: nothing to move
            req.status, req.stop_reason = status, reason
            req.first_token_time = req.finish_time = now
            req.token_times.append(now)
            del self._tracked[req.request_id]
            outputs.append(self._output(tracked))
        return outputs

    def _transfer_ready(self) -> list[RequestOutput]:
        """Move waiting blocks into the decode pool, oldest first, while it has room."""
        outputs = []
        while self._pending:
            h = self._pending[0]
            if not self.scheduler.add_prefilled(h.req, h.num_tokens):
                break
            self._pending.popleft()
            start = time.perf_counter()
            moved = self.runner.put_pages(h.block)
            self.runner.insert_pages(moved, h.req.page_ids)
            jax.block_until_ready(self.runner.kv_caches)
            slots = h.block.shape[2] * h.block.shape[3]  # page slots in the block (bucket pages x page_size)
            record = KVTransfer(h.req.request_id, h.num_tokens, h.block.nbytes // slots * h.num_tokens,
                                int(h.block.nbytes), time.perf_counter() - start)
            self.transfers.append(record)
            self.counters["kv_transfers"] += 1
            self.counters["kv_transfer_bytes"] += record.num_bytes
            self.counters["kv_transfer_block_bytes"] += record.block_bytes
            self.counters["kv_transfer_seconds"] += record.seconds
            now = self.clock()
            h.req.first_token_time = now
            h.req.token_times.append(now)
            outputs.append(self._output(self._tracked[h.req.request_id]))
        return outputs

    # Reporting -------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Both pools' gauges, the transfer and pool counters, and the pools' rates (`pool_rates`)."""
        out = super().stats()
        out["num_waiting"] += self.prefill.scheduler.num_waiting + len(self._pending)
        out.update(prefill_num_running=self.prefill.scheduler.num_running,
                   prefill_kv_usage=self.prefill.kv_manager.usage(), pending_transfers=len(self._pending))
        out.update({k: v for k, v in pool_rates(self.counters).items() if v is not None})
        return out

    def integrity_check(self) -> None:
        """Both pools' page accounting (free + cached + in use == usable)."""
        self.prefill.scheduler.integrity_check()
        self.scheduler.integrity_check()

