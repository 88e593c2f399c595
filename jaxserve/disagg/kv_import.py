"""The decode role's engine: requests arrive with their prompt's KV and first token, and only decode here.

`DecodeEngine.stage(request_id, arrival)` (from the event loop, before the request is submitted) leaves a pulled
block for the request; when the request is added it is held back from the waiting queue, and at the next step
it is admitted with pages for its prompt (the same room rule as admission: a sequence slot, the pages, the running
requests' growth reservation; a lone request always fits), the block is written into those pages (heads
replicated up to this pool's TP layout), and its first token is emitted. A request added with nothing staged is
prefilled here, as on a colocated server (structured outputs, prompt logprobs, no prefill server reachable).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from jaxserve.config.engine import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.request import Request, RequestStatus
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.scheduler.scheduler import Scheduler


@dataclass
class Arrival:
    """A request's prefill, done elsewhere: its KV blocks (first page, pages, block), prompt length, first token."""

    blocks: list[tuple[int, int, jax.Array]]
    num_tokens: int
    first_token: int
    logprobs: dict[int, float] | None
    seconds: float  # from asking the prefill server to holding the block here


class _ImportingScheduler(Scheduler):
    """The decode engine's scheduler: it can take a request back from its waiting queue and admit it prefilled."""

    def hold(self, req: Request) -> None:
        """Take a just-added request back out (its KV comes from elsewhere)."""
        self.waiting.remove(req)
        del self.requests[req.request_id]

    def add_prefilled(self, req: Request, num_tokens: int) -> bool:
        """Admit `req` with pages for its first `num_tokens` tokens, about to be written; False if no room."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        req.page_ids, req.num_computed_tokens = [], 0
        reserved = sum(self._growth_pages(r) for r in self.running)
        if self.running and self.kv.pages_for(num_tokens + 1) + reserved > self.kv.num_free_pages:
            return False
        if not self.kv.allocate(req, num_tokens):
            return False
        req.num_computed_tokens = num_tokens
        req.num_cached_tokens = 0
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.requests[req.request_id] = req
        return True


class DecodeEngine(LLMEngine):
    """An `LLMEngine` that also admits requests prefilled by another server (see module doc)."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        # Inserted pages carry no prefix-cache entries (as the in-process decode pool): no cache to keep here.
        super().__init__(dataclasses.replace(config, enable_prefix_caching=False), clock)
        self.scheduler = _ImportingScheduler(self.scheduler.config, self.kv_manager)
        self._lock = threading.Lock()
        self._staged: dict[str, Arrival] = {}
        self._held: deque[tuple[Request, Arrival]] = deque()
        self.counters.update(kv_imports=0, kv_import_bytes=0, kv_import_seconds=0.0, kv_insert_seconds=0.0)
        if config.warmup:
            self.runner.warmup_transfer(self.spec.num_kv_heads, gather=False)

    def stage(self, request_id: str, arrival: Arrival) -> None:
        """Leave `arrival` for the request `request_id` about to be added (thread-safe)."""
        with self._lock:
            self._staged[request_id] = arrival

    def unstage(self, request_id: str) -> None:
        """Drop an arrival whose request was never added (thread-safe, idempotent)."""
        with self._lock:
            self._staged.pop(request_id, None)

    def add_request(self, request_id: str, prompt: str | list[int], params: Any, **kwargs: Any) -> Request:
        with self._lock:
            arrival = self._staged.pop(request_id, None)
        req = super().add_request(request_id, prompt, params, **kwargs)
        if arrival is not None:
            self.scheduler.hold(req)
            self._held.append((req, arrival))
        return req

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or bool(self._held)

    def step(self) -> list[RequestOutput]:
        """Admit the prefilled requests there is room for (their first tokens), then one step of the loop."""
        outputs = self._admit_held()
        if self.scheduler.has_work():
            outputs += super().step()
        return outputs

    def _admit_held(self) -> list[RequestOutput]:
        outputs = []
        while self._held:
            req, arrival = self._held[0]
            tracked = self._tracked.get(req.request_id)
            if tracked is None or tracked.request is not req:  # aborted while it waited
                self._held.popleft()
                continue
            if not self.scheduler.add_prefilled(req, arrival.num_tokens):
                break
            self._held.popleft()
            start = time.perf_counter()
            for first, num_pages, block in arrival.blocks:
                self.runner.insert_pages(self.runner.put_pages(block), req.page_ids[first:first + num_pages])
                self.counters["kv_import_bytes"] += int(block.nbytes)
            if arrival.blocks:
                jax.block_until_ready(self.runner.kv_caches)
                self.counters["kv_imports"] += 1
            self.counters["kv_import_seconds"] += arrival.seconds
            self.counters["kv_insert_seconds"] += time.perf_counter() - start
            outputs.append(self._first_token(tracked, arrival))
        return outputs

    def _first_token(self, tracked: Any, arrival: Arrival) -> RequestOutput:
        """Stamp the prefill server's token as this request's first, check its stops, describe it."""
        req = tracked.request
        now = self.clock()
        req.output_token_ids.append(arrival.first_token)
        req.first_token_time = now
        req.token_times.append(now)
        self.counters["generation_tokens"] += 1
        if tracked.logprobs is not None and arrival.logprobs is not None:
            tracked.logprobs.append(arrival.logprobs)
        finish = tracked.stops.check(req)
        if finish is not None:
            status, req.stop_reason = finish
            req.finish_time = now
            self.scheduler.finish_request(req, status)
            del self._tracked[req.request_id]
        return self._output(tracked)

    def stats(self) -> dict[str, float]:
        out = super().stats()
        out["num_waiting"] += len(self._held)
        return out
