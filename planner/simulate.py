"""Discrete-event simulation of the runtime's scheduler, timed by the step model.

Same scheduler as `planner.serving` models in closed form: each step carries every running decode first
(one token each), then prefill chunks (cut on page boundaries, as the runtime cuts them), oldest request
first, within `chunk_size` tokens; steps run at the runtime's padded token count (`token_buckets`); a waiting request is
admitted while fewer than `max_num_seqs` sequences (and the KV cache's share) are running. The first token
comes at the end of the step that computes the last prompt token. Preemption is not modelled (admission
keeps to the KV capacity for the full output). Used by the tests to check the closed form, and by
`jaxserve plan --simulate`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from modelspec.memory import plan_memory
from modelspec.spec import ModelSpec
from planner.hardware import Hardware
from planner.serving import Dist, ServingConfig, Workload
from planner.step_model import (
    StepShape,
    decode_shape,
    pad_tokens,
    prefill_chunk_tokens,
    prefill_shape,
    step_time_shape,
)


@dataclass
class _Req:
    arrival: float
    input_len: int
    to_compute: int
    output_len: int
    computed: int = 0
    generated: int = 0
    first_token: float = -1.0
    last_token: float = -1.0
    finish: float = -1.0

    @property
    def start(self) -> int:
        """Prompt tokens served from the prefix cache (already computed before the first chunk)."""
        return self.input_len - self.to_compute


@dataclass
class SimResult:
    """Measured (simulated) metrics over the requests kept after warm-up, all replicas together."""

    ttft: Dist
    tpot: Dist
    itl: Dist
    requests_per_s: float
    output_tokens_per_s: float
    mean_decode_batch: float
    num_requests: int
    num_steps: int


def simulate(spec: ModelSpec, hw: Hardware, workload: Workload, config: ServingConfig, *,
             num_requests: int = 1000, seed: int = 0, warmup_fraction: float = 0.1,
             arrival_times: Sequence[float] | None = None) -> SimResult:
    """Simulate one replica at rate/replicas (or concurrency/replicas clients) and report its metrics.

    Requests are sent as `vllm bench serve` sends them (gamma gaps of shape `workload.burstiness`, at most
    `workload.concurrency` in flight, TTFT counted from the send); `workload.num_prompts`, when given, is the
    run's length and every request counts (no warm-up cut). `arrival_times`: explicit arrival times (s, one
    replica, open loop) instead of Poisson draws, to predict one measured run of a finite trace (a short run
    from an empty engine is a transient, not the steady state that `planner.serving` predicts).
    """
    rng = np.random.default_rng(seed)
    mem = plan_memory(spec, hw.memory_bytes, tp=config.tp, dtype=config.dtype, kv_dtype=config.kv_dtype,
                      page_size=config.page_size, chunk_size=config.chunk_size, max_num_seqs=config.max_num_seqs,
                      gpu_memory_utilization=config.gpu_memory_utilization)
    slots = max(1, min(config.max_num_seqs, mem.max_concurrency(workload.input_len + workload.output_len)))
    r = config.replicas
    s = workload.spread

    def new_request(t: float) -> _Req:
        i = max(1, round(workload.input_len * rng.uniform(1 - s, 1 + s))) if s else workload.input_len
        o = max(1, round(workload.output_len * rng.uniform(1 - s, 1 + s))) if s else workload.output_len
        comp = max(1, round(i * (1 - workload.prefix_hit)))
        return _Req(arrival=t, input_len=i, to_compute=comp, output_len=o)

    gate = max(1, round(workload.concurrency / r)) if workload.concurrency and arrival_times is None else None
    if workload.num_prompts is not None and arrival_times is None:  # one run, measured whole as a bench does
        num_requests, warmup_fraction = max(1, round(workload.num_prompts / r)), 0.0
    if arrival_times is not None:
        sends = sorted(float(a) for a in arrival_times)
    elif workload.request_rate is not None:  # vLLM's bench: the first at 0, then gamma gaps of mean 1 / rate
        b, rate = workload.burstiness, workload.request_rate / r
        sends = np.concatenate([[0.0], np.cumsum(rng.gamma(b, 1 / (rate * b), num_requests - 1))]).tolist()
    else:  # clients only: every one sends at once, then each when its last request ends
        sends = [0.0] * num_requests
    arrivals: deque[_Req] = deque()
    pending: deque[float] = deque(sends)

    def release(free_at: float) -> None:
        """The next request takes a free client slot: sent at its own time or when the slot freed, if later
        (the send times stay ordered: both sequences only grow)."""
        if pending:
            arrivals.append(new_request(max(pending.popleft(), free_at)))

    for _ in range(len(sends) if gate is None else gate):
        release(0.0)
    prefill_first = config.scheduler == "prefill-first"
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    done: list[_Req] = []
    itls: list[float] = []
    now, steps, batch_sum = 0.0, 0, 0
    while arrivals or waiting or running:
        while arrivals and arrivals[0].arrival <= now:
            waiting.append(arrivals.popleft())
        if not waiting and not running:
            now = arrivals[0].arrival
            continue
        decodes = [q for q in running if q.computed >= q.to_compute]
        if prefill_first and (len(decodes) < len(running) or (waiting and len(running) < slots)):
            decodes = []  # prompts to prefill take the step to themselves; the decodes wait
        budget = config.chunk_size - len(decodes)
        shape = StepShape()
        if decodes:
            ctx = sum(q.input_len + q.generated for q in decodes) / len(decodes)
            shape = decode_shape(len(decodes), ctx)
        chunks: list[tuple[_Req, int]] = []
        for q in running:
            if q.computed < q.to_compute and budget > 0:
                n = prefill_chunk_tokens(q.start + q.computed, q.to_compute - q.computed, budget, config.page_size)
                chunks.append((q, n))
                budget -= n
        while waiting and budget > 0 and len(running) < slots:
            q = waiting.popleft()
            running.append(q)
            n = prefill_chunk_tokens(q.start, q.to_compute, budget, config.page_size)
            chunks.append((q, n))
            budget -= n
        for q, n in chunks:
            shape = shape + prefill_shape(n, q.start + q.computed)
        dt = step_time_shape(spec, hw, shape, tp=config.tp, dtype=config.dtype, kv_dtype=config.kv_dtype,
                             padded_tokens=pad_tokens(shape.num_tokens, config.token_buckets),
                             steps_per_dispatch=config.num_scheduler_steps,
                             overlapped=config.async_scheduling).total_s
        now += dt
        steps += 1
        batch_sum += len(decodes)
        finished: list[_Req] = []
        for q in decodes:
            q.generated += 1
            itls.append(now - q.last_token)
            q.last_token = now
            if q.generated >= q.output_len:
                finished.append(q)
        for q, n in chunks:
            q.computed += n
            if q.computed >= q.to_compute:
                q.first_token = q.last_token = now
                q.generated = 1
                if q.output_len <= 1:
                    finished.append(q)
        for q in finished:
            q.finish = now
            running.remove(q)
            done.append(q)
            if gate is not None:
                release(now)
    done.sort(key=lambda q: q.arrival)
    k = int(len(done) * warmup_fraction)
    kept = done[k:len(done) - k] if len(done) > 4 * k else done
    ttft = np.array([q.first_token - q.arrival for q in kept])
    tpot = np.array([(q.finish - q.first_token) / (q.output_len - 1) for q in kept if q.output_len > 1])
    span = max(q.finish for q in kept) - min(q.arrival for q in kept)
    rps = len(kept) / span * r if span > 0 else 0.0
    out_tokens = sum(q.output_len for q in kept)
    return SimResult(ttft=Dist.of(ttft), tpot=Dist.of(tpot), itl=Dist.of(np.array(itls)), requests_per_s=rps,
                     output_tokens_per_s=out_tokens / span * r if span > 0 else 0.0,
                     mean_decode_batch=batch_sum / max(steps, 1), num_requests=len(kept), num_steps=steps)
