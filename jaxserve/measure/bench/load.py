"""Arrival processes and the in-process load driver (an LLMEngine loop on an arrival clock).

Arrivals follow vLLM's `bench serve`: gaps drawn from a gamma distribution with shape `burstiness` and mean
1/rate (burstiness 1 = Poisson); rate inf sends everything at once; `max_concurrency` caps requests in
flight. A request that depends on another (`SampleRequest.wait_for`) arrives when both its own time has
come and its dependency is ready. Its arrival time is what TTFT is measured from.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.measure.bench.datasets import SampleRequest
from jaxserve.measure.bench.results import RequestRecord


@dataclass
class LoadConfig:
    """How requests are sent."""

    request_rate: float = math.inf  # requests/s; inf = all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1 = Poisson, < 1 burstier, > 1 smoother
    max_concurrency: int | None = None
    seed: int = 0
    # Sampling of every request (vLLM's bench flags); the default is greedy.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0

    def sampling(self, max_tokens: int):
        """The requests' SamplingParams (exact lengths: ignore_eos)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              max_tokens=max_tokens, ignore_eos=True)

    def __post_init__(self) -> None:
        self.sampling(1)  # the sampling flags' own checks (ValueError)
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be positive or inf, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be at least 1, got {self.max_concurrency}")


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times (s from the start) of n requests: the first at 0, then gamma(shape=b, mean=1/rate) gaps."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


@dataclass
class StepRecord:
    """One engine step as the driver saw it (times on the engine clock, relative to the start)."""

    end: float
    duration: float
    num_tokens: int
    num_decodes: int
    num_prefill_tokens: int
    decode_context_tokens: int = 0  # sum of the decodes' KV lengths
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)  # (chunk tokens, tokens before it)


@dataclass
class RunResult:
    """What a load run produced."""

    records: list[RequestRecord]
    duration: float  # first send to last completion (s)
    steps: list[StepRecord] = field(default_factory=list)
    token_times: list[list[float]] = field(default_factory=list)  # per request, relative to the start
    counters: dict[str, float] = field(default_factory=dict)


def _record_from_output(out, prompt_len: int, start: float, role: str) -> RequestRecord:
    m = out.metrics
    times = m.token_times
    ok = bool(times) and out.finish_reason not in (None, "abort")
    return RequestRecord(prompt_len=prompt_len, success=ok, output_len=len(out.token_ids),
                         ttft=(times[0] - m.arrival_time) if times else 0.0,
                         itl=[b - a for a, b in zip(times, times[1:], strict=False)],
                         latency=(times[-1] - m.arrival_time) if times else 0.0,
                         error="" if ok else f"finished with {out.finish_reason}",
                         cached_tokens=out.num_cached_tokens, arrival=m.arrival_time - start, role=role,
                         spec_steps=m.spec_num_steps, spec_draft_tokens=m.spec_num_draft_tokens,
                         spec_accepted_tokens=m.spec_num_accepted_tokens)


class _Gate:
    """Tracks when each request's dependency and concurrency slot became ready."""

    def __init__(self, requests: Sequence[SampleRequest], max_concurrency: int | None):
        self.requests = requests
        self.max_concurrency = max_concurrency
        self.tokens = [0] * len(requests)
        self.finished: dict[int, float] = {}
        self.token_reached: dict[tuple[int, int], float] = {}
        self.in_flight = 0
        self.slot_ready = -math.inf

    def dependency_ready(self, i: int) -> float | None:
        """Time the dependency of request i was met, or None while it is not."""
        r = self.requests[i]
        if r.wait_for is None:
            return -math.inf
        if r.wait_tokens is None:
            return self.finished.get(r.wait_for)
        if r.wait_for in self.finished and self.tokens[r.wait_for] < r.wait_tokens:
            return self.finished[r.wait_for]
        return self.token_reached.get((r.wait_for, r.wait_tokens))

    def on_tokens(self, i: int, n: int, now: float) -> None:
        for j in range(self.tokens[i] + 1, n + 1):
            self.token_reached[(i, j)] = now
        self.tokens[i] = n

    def on_finish(self, i: int, now: float) -> None:
        self.finished[i] = now
        if self.max_concurrency is not None and self.in_flight == self.max_concurrency:
            self.slot_ready = now
        self.in_flight -= 1

    def has_slot(self) -> bool:
        return self.max_concurrency is None or self.in_flight < self.max_concurrency


def _with_previous_answer(requests: Sequence[SampleRequest], i: int, answers: dict[int, list[int]],
                          sent: dict[int, list[int]]) -> list[int]:
    """A multi-turn prompt as a chat client sends it: the previous turn's prompt as it was sent, the model's
    real answer to it (in place of the dataset's stand-in of the same length), then the new message."""
    req = requests[i]
    prev = req.wait_for
    prompt = req.prompt
    if req.conversation is not None and prev is not None and prev in answers:
        head, answer = sent[prev], answers[prev]
        prompt = head + answer + req.prompt[len(head) + len(answer):]
    sent[i] = prompt
    return prompt


def run_engine(engine, requests: Sequence[SampleRequest], load: LoadConfig, *, salt: str = "",
               on_step: Callable[[int], None] | None = None) -> RunResult:
    """Drive `engine` (an LLMEngine) with `requests` sent as `load` says (its sampling; ignore_eos, exact lengths).

    `salt` keeps runs' prompts from hitting each other's prefix cache (pass a fresh one per run).
    """
    clock = engine.clock
    offsets = arrival_offsets(len(requests), load.request_rate, load.burstiness, load.seed)
    gate = _Gate(requests, load.max_concurrency)
    pending = list(range(len(requests)))
    records: list[RequestRecord | None] = [None] * len(requests)
    token_times: list[list[float]] = [[] for _ in requests]
    index: dict[str, int] = {}
    steps: list[StepRecord] = []
    answers: dict[int, list[int]] = {}  # finished requests' output ids
    sent: dict[int, list[int]] = {}  # the prompts as sent
    counters0 = dict(engine.counters)
    start = clock()
    while pending or engine.has_unfinished_requests():
        now = clock()
        for i in list(pending):
            ready = gate.dependency_ready(i)
            if ready is None or start + offsets[i] > now or not gate.has_slot():
                continue
            pending.remove(i)
            req = requests[i]
            rid = f"bench{salt}-{i}"
            arrival = max(start + offsets[i], ready, gate.slot_ready if load.max_concurrency else -math.inf)
            params = load.sampling(req.output_len)
            try:
                engine.add_request(rid, _with_previous_answer(requests, i, answers, sent), params,
                                   arrival_time=min(arrival, now),
                                   cache_salt=salt or None)
            except ValueError as e:
                records[i] = RequestRecord(prompt_len=req.prompt_len, error=str(e), role=req.role,
                                           arrival=now - start)
                gate.finished[i] = now
                continue
            index[rid] = i
            gate.in_flight += 1
        if not engine.has_unfinished_requests():
            waiting = [start + offsets[i] for i in pending if gate.dependency_ready(i) is not None]
            if not waiting:
                for i in pending:  # dependencies that can never be met (a failed request)
                    records[i] = RequestRecord(prompt_len=requests[i].prompt_len, error="dependency failed",
                                               role=requests[i].role)
                break
            time.sleep(max(0.0, min(waiting) - clock()))
            continue
        outputs = engine.step()
        if engine.last_step is not None:
            s = engine.last_step
            steps.append(StepRecord(end=s.time - start, duration=s.duration, num_tokens=s.num_tokens,
                                    num_decodes=s.num_decode_tokens, num_prefill_tokens=s.num_prefill_tokens,
                                    decode_context_tokens=s.decode_context_tokens,
                                    prefill_chunks=list(s.prefill_chunks)))
        for out in outputs:
            i = index.get(out.request_id)
            if i is None:
                continue
            now = out.metrics.token_times[-1] if out.metrics.token_times else clock()
            gate.on_tokens(i, len(out.token_ids), now)
            if out.finished:
                answers[i] = list(out.token_ids)
                records[i] = _record_from_output(out, requests[i].prompt_len, start, requests[i].role)
                token_times[i] = [t - start for t in out.metrics.token_times]
                gate.on_finish(i, now)
        if on_step is not None:
            on_step(sum(r is not None for r in records))
    end = clock()
    done = [r for r in records if r is not None]
    last = max((r.arrival + r.latency for r in done if r.success), default=end - start)
    counters = {k: engine.counters[k] - counters0.get(k, 0) for k in engine.counters}
    return RunResult(records=[r for r in records if r is not None], duration=max(last, 1e-9), steps=steps,
                     token_times=token_times, counters=counters)
