"""Closed-form serving model: TTFT, TPOT and ITL under load for continuous batching with chunked prefill.

The scheduler being modelled (the runtime's, vLLM V1 style): every step carries all running decodes first
(one token each), then prefill chunks within a token budget `chunk_size` (max_num_batched_tokens), at most
`max_num_seqs` sequences in flight (and no more than the KV cache holds).

Per replica, at a Poisson request rate lambda:
- Decode batch from Little's law as a fixed point: B = lambda * (O - 1) * tau, where the mean step time is
  tau = t_dec(B) / (1 - lambda * E[Delta]), t_dec(B) the decode-only step and Delta a prompt's marginal
  prefill time (the extra time its chunks add to the steps that carry them).
- Prefill as an M/G/1-type queue with vacations (the server looks at the queue only at step boundaries) and
  bulk service: the residual of the prefill or decode step in progress, then the prompts queued ahead, each
  adding its Delta and its share of a step (t_dec I/c', c' = chunk_size - B) only when they overflow the
  budget; W = R / (1 - lambda E[per prompt ahead]).
- Slots: if max_num_seqs (or KV) binds, an Erlang-C wait for a slot (M/M/c approximation).
- Closed loop (`concurrency` clients, no think time): with fixed lengths the clients move in waves
  (`planner.closed_loop`); with spread lengths their arrivals spread out and throughput X solves
  X * E2E(X) = min(C, slots), with queueing seen by an arrival scaled by (C - 1) / C (arrival theorem); extra
  clients wait for a slot. A rate and clients together (`vllm bench serve --request-rate R --max-concurrency N`)
  are the stream while the gate lets it through, else the loop; gamma gaps (`burstiness` b) scale the busy part
  of the wait by (1/b + c_s^2) / (1 + c_s^2) (Kingman).
Percentiles come from sampling the same distributions (exponential queue tail, binomial count of
prefill-carrying steps per request); `planner.simulate` checks the means against a discrete-event run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from modelspec.memory import MemoryPlan, plan_memory
from modelspec.spec import ModelSpec
from planner.closed_loop import LoopResult, lockstep_loop
from planner.hardware import Hardware
from planner.queueing import erlang_c, poisson_at_least
from planner.serving_steps import StepCosts
from planner.step_model import StepTime, decode_shape, prefill_shape, step_time_shape
from planner.workload import Dist, ServingConfig, Workload

__all__ = ["Dist", "ServingConfig", "ServingPrediction", "Workload", "erlang_c", "max_rate", "predict_serving"]

SAMPLES = 4000


@dataclass
class ServingPrediction:
    """Predicted serving metrics for a whole deployment (all replicas)."""

    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e_ms: float
    output_tokens_per_s: float
    requests_per_s: float
    goodput_requests_per_s: float
    stable: bool
    load: float  # offered rate / max sustainable rate (per replica)
    decode_batch: float  # mean running decodes per replica
    decode_step: StepTime
    prefill_chunk_step: StepTime
    memory: MemoryPlan
    max_concurrency: int  # sequences per replica the KV cache and max_num_seqs allow
    capacity_requests_per_s: float  # max sustainable rate, all replicas
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def bottleneck(self) -> str:
        """One sentence: what limits this deployment."""
        d = self.decode_step
        if not self.stable:
            return "overloaded: the offered load exceeds what this configuration can sustain"
        kind = d.bottleneck.replace("_", " ")
        s = f"decode steps are {kind}-bound ({d.terms[d.bottleneck] / d.total_s:.0%} of {d.total_ms:.1f} ms)"
        waves = self.extra.get("closed_loop")
        if waves:
            s += (f"; the clients move in waves ({waves}): a prompt's TTFT holds the prompts sent with it"
                  if waves != "prefill-bound" else "; the clients' prompts keep every step busy: TTFT is their queue")
        elif self.load > 0.8:
            s += f"; at {self.load:.0%} of capacity, queueing dominates TTFT"
        return s


@dataclass
class _State:
    stable: bool
    tau: float = math.inf  # mean step time seen by a decode (mean TPOT)
    t_d: float = math.inf
    batch: float = 0.0
    rho: float = 1.0
    wait_prefill: float = math.inf
    wait_slot: float = 0.0
    own_prefill: float = math.inf
    f_mixed: float = 0.0
    chunk_deltas: list[float] = field(default_factory=list)
    ttft_mean: float = math.inf
    service: float = math.inf  # slot holding time: prefill + decode
    queue: float = 0.0  # mean Pollaczek-Khinchine wait for prefill work ahead
    resid: float = 0.0  # mean residual of the step in progress at arrival
    tpot_extra: float = 0.0  # decode stall from prompts queued behind this request


def _solve(m: StepCosts, lam: float, seen: float = 1.0, slot_wait: bool = True, burstiness: float = 1.0,
           at_step_ends: bool = False) -> _State:
    """Fixed point at rate `lam` per replica; `seen` scales the queueing an arrival sees (closed loop);
    `burstiness`: the gamma shape of the gaps between arrivals (1: Poisson); `at_step_ends`: requests arrive as
    a step ends (a closed loop's client sends when its last token comes), so none waits out a step in progress."""
    out = m.wl.output_len
    pts = m.input_points()
    pts_l = [float(i) for i in pts]

    def step(tau: float) -> tuple[float, float]:
        b = min(lam * max(out - 1, 0) * tau, m.slots)
        mean_delta = sum(m.prefill(b, i)[0] for i in pts_l) / len(pts_l)
        denom = 1 - lam * seen * mean_delta
        # A decoding request sees itself plus the others: for a Poisson-like batch the token-weighted
        # batch is E[B^2] / E[B] = B + 1 (closed loop: scaled by the arrival theorem).
        return (m.t_dec(min(b + seen, m.slots)) / denom if denom > 0 else math.inf), b

    lo, hi = m.t_dec(1) * 0.5, m.t_dec(m.slots) / max(1e-9, 1 - lam * m.prefill(m.slots, pts.max())[0]) * 4 + 1
    if not math.isfinite(hi) or step(hi)[0] > hi:
        return _State(stable=False)
    for _ in range(32):
        mid = 0.5 * (lo + hi)
        if step(mid)[0] > mid:
            lo = mid
        else:
            hi = mid
    tau = hi
    _, b = step(tau)
    t_d = m.t_dec(min(b + seen, m.slots))
    c = m.budget(b)
    s_samples, own_samples, n_lone = [], [], []
    b_seen = b * seen  # decodes running when a request arrives (closed loop: the others' only)
    t_seen = m.t_dec(b_seen) if b_seen >= 1 else b_seen * m.t_dec(1)
    for i in pts:
        delta, n, _ = m.prefill(b, i)
        s_samples.append(delta + i / c * t_d)
        delta_seen, n_seen, _ = m.prefill(b_seen, i)
        own_samples.append(delta_seen + n_seen * t_seen)
        n_lone.append(n)
    es = float(np.mean(s_samples))
    rho = lam * es
    if rho >= 1:
        return _State(stable=False)
    mixed_per_s = lam * ((1 - rho) * float(np.mean(n_lone)) + rho * float(np.mean(pts)) / c)
    f = min(1.0, mixed_per_s * tau)
    _, _, deltas = m.prefill(b, float(np.mean(pts)))
    lone = np.array(own_samples)
    # Residual at arrival: of a lone prefill in service (it keeps the server until done, FCFS) or of a
    # decode-only step.
    u = min(1.0, (rho + lam * float(lone.mean())) / 2)
    resid = seen * (u * float(np.mean(lone**2)) / (2 * float(lone.mean())) + (1 - u) * t_d / 2)
    if at_step_ends:  # and clients whose requests came back later come back later: they queue at most as
        resid = 0.0  # Little's law leaves them to (`_closed_loop`)
    # Prompts queued ahead: each adds its Delta; its share of step time only when the prompts ahead overflow
    # the step's budget (bulk service: about k = c'/I prompts share a step). With N ahead ~ geometric of mean
    # L = lam W, the overflow fraction is p^(k-1), p = L / (1 + L).
    mean_i = float(np.mean(pts))
    k = c / mean_i
    mean_d = float(np.mean([m.prefill(b, i)[0] for i in pts]))  # E[Delta]
    wait = resid
    for _ in range(50):
        L = lam * seen * wait
        p_tail = (L / (1 + L)) ** max(k - 1, 0.0) if L > 0 else (1.0 if k <= 1 else 0.0)
        per_ahead = mean_d + t_d * mean_i / c * p_tail
        new_wait = resid / max(1e-9, 1 - lam * seen * per_ahead)
        if abs(new_wait - wait) < 1e-9:
            break
        wait = new_wait
    if burstiness != 1:  # G/G/1 (Kingman): the busy part of the wait scales by (c_a^2 + c_s^2) / (1 + c_s^2)
        cs2 = m.wl.spread**2 / 3  # prompt lengths uniform in [I(1-s), I(1+s)]
        idle = seen * (1 - u) * t_d / 2
        wait = idle + (wait - idle) * (1 / burstiness + cs2) / (1 + cs2)
    queue = wait - resid
    own = float(lone.mean())
    # Its last step also carries the prompts that arrived behind it, up to the token budget.
    # (arrivals during that step itself come too late for it).
    last = t_seen + m.prefill(b_seen, mean_i)[2][-1]
    lone_own = own
    # (A closed loop's requests come as steps end: those of the same step end share its next step.)
    window = t_seen if at_step_ends else wait + own - last
    own += _packed_extra(m, b, lam * seen * window, mean_i, c)
    # The same packing, seen from the packed side: a request arriving while another prompt still has steps to
    # go rides its first chunk in that prompt's last step, so it needs one step fewer than alone.
    if max(n_lone) > 1 and not at_step_ends:
        own -= min(1.0, lam * seen * (lone_own - last)) * last
    # Prompts that arrived during this request's wait and prefill and were not packed into its own last step
    # stall its decode: extra TPOT = lam * TTFT * E[Delta] * (1 - packable) / ((O - 1) (1 - lam E[Delta])).
    # Prompts that arrive during its own last prefill step come too late to be packed into it: they are
    # prefilled in the step after, the first of its decode life (the Wald count lam * E[life] in tau only
    # covers arrivals from its first token on, less those in its last decode step).
    packable = max(0.0, 1 - mean_i / c)
    late = max(0.0, last - t_d)
    tpot_extra = (lam * seen * ((wait + own) * (1 - packable) + late) * mean_d
                  / (max(out - 1, 1) * max(1e-9, 1 - lam * mean_d)))
    service = own + wait + max(out - 1, 0) * (tau + tpot_extra)
    ws = 0.0
    if lam * service >= m.slots:
        return _State(stable=False)
    if slot_wait:
        a = lam * seen * service
        pw = erlang_c(m.slots, a)
        ws = pw * service / max(m.slots - a, 1e-9)
    return _State(stable=True, tau=tau, t_d=t_d, batch=b, rho=rho, wait_prefill=wait, wait_slot=ws, own_prefill=own,
                  f_mixed=f, chunk_deltas=deltas, ttft_mean=own + wait + ws, service=service, queue=queue,
                  resid=resid, tpot_extra=tpot_extra)


def _packed_extra(m: StepCosts, b: float, mu: float, prompt: float, budget: int) -> float:
    """Expected extra time of a request's last prefill step from N ~ Poisson(mu) later prompts packed into it."""
    rem = prompt - (math.ceil(prompt / budget) - 1) * budget
    room = budget - rem
    if room <= 0 or mu <= 0:
        return 0.0
    per_token = m.prefill(b, budget)[0] / budget if budget <= prompt else m.prefill(b, prompt)[0] / prompt
    tokens, pmf, cdf, n = 0.0, math.exp(-mu), 0.0, 0
    while n * prompt < room and n < 10_000:  # E[min(N * prompt, room)]
        tokens += pmf * n * prompt
        cdf += pmf
        n += 1
        pmf *= mu / n
    return (tokens + max(0.0, 1 - cdf) * room) * per_token


def max_rate(m: StepCosts) -> float:
    """Largest Poisson rate per replica with a stable fixed point (bisection)."""
    lo, hi = 0.0, 1.0
    while _solve(m, hi).stable and hi < 1e7:
        lo, hi = hi, hi * 2
    for _ in range(24):
        mid = 0.5 * (lo + hi)
        if _solve(m, mid).stable:
            lo = mid
        else:
            hi = mid
    return lo


def _closed_loop(m: StepCosts, clients: float, cap: float) -> tuple[float, _State]:
    """Throughput per replica and state for `clients` closed-loop clients (no think time) whose arrivals are
    spread out: each comes as a step ends, so no residual step; a client delayed comes back later, so the
    clients space themselves out and a prompt waits only when the engine cannot turn them all around
    (measured by the simulator: TTFT within 10% of the prompt's own prefill up to 60% prefill utilisation)."""
    in_service = min(clients, m.slots)
    seen = max(0.0, (clients - 1) / clients)
    lo, hi = 0.0, cap
    st = _State(stable=False)
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        s = _solve(m, mid, seen=seen, slot_wait=False, at_step_ends=True)
        if s.stable and mid * s.service < in_service:
            lo, st = mid, s
        else:
            hi = mid
    if not st.stable:
        st = _solve(m, lo, seen=seen, slot_wait=False, at_step_ends=True) if lo > 0 else st
    if st.stable and lo > 0:  # clients beyond what the engine turns around wait for the prefill (Little's law)
        behind = max(0.0, in_service / lo - st.service)
        st.wait_prefill += behind
        st.queue += behind
        st.ttft_mean += behind
    if st.stable and clients > m.slots and lo > 0:
        st.wait_slot = (clients - m.slots) / lo
        st.ttft_mean += st.wait_slot
    return lo, st


def _load(m: StepCosts, cap: float) -> tuple[float, _State]:
    """Rate and state per replica: a Poisson (or gamma, `burstiness`) stream, a loop of clients whose arrivals
    are spread out (spread lengths break the waves), or both (vLLM's --request-rate with --max-concurrency): the
    stream below the loop's throughput, where the clients' gate seldom holds a request back, else the loop."""
    wl, r = m.wl, m.cfg.replicas
    rate = (wl.request_rate if wl.request_rate is not None else cap * 0.5 * r) / r
    if wl.concurrency is None:
        return rate, _solve(m, rate, burstiness=wl.burstiness)
    lam, st = _closed_loop(m, wl.concurrency / r, cap)
    if wl.request_rate is not None and rate < lam:
        open_st = _solve(m, rate, burstiness=wl.burstiness)
        if open_st.stable:  # the gate holds back the arrivals that find all clients busy: their waits are the loop's
            busy = poisson_at_least(round(min(wl.concurrency / r, m.slots)), rate * open_st.service)
            for name in ("own_prefill", "wait_prefill", "queue", "resid", "ttft_mean"):
                setattr(open_st, name, (1 - busy) * getattr(open_st, name) + busy * getattr(st, name))
            return rate, open_st
    return lam, st


def _lockstep_prediction(m: StepCosts, loop: LoopResult, cap: float, ttft_slo_ms: float | None,
                         tpot_slo_ms: float | None) -> ServingPrediction:
    """The prediction for clients in waves, from the loop's per-request figures."""
    cfg, wl, r = m.cfg, m.wl, m.cfg.replicas
    dec, chunk = _reported_steps(m, loop.decode_batch)
    ok = np.ones(len(loop.ttft), dtype=bool)
    if ttft_slo_ms is not None:
        ok &= loop.ttft * 1e3 <= ttft_slo_ms
    if tpot_slo_ms is not None:
        ok &= loop.tpot * 1e3 <= tpot_slo_ms
    lam = loop.requests_per_s
    cap = max(cap, lam)  # waves keep the engine busier than spread-out arrivals can
    return ServingPrediction(
        ttft=Dist.of(loop.ttft), tpot=Dist.of(loop.tpot), itl=Dist.of(loop.itl),
        e2e_ms=float(np.mean(loop.ttft + loop.tpot * max(wl.output_len - 1, 0))) * 1e3,
        output_tokens_per_s=lam * r * wl.output_len, requests_per_s=lam * r,
        goodput_requests_per_s=lam * r * float(ok.mean()), stable=True, load=lam / cap if cap else math.inf,
        decode_batch=loop.decode_batch, decode_step=dec, prefill_chunk_step=chunk, memory=m.mem,
        max_concurrency=m.slots, capacity_requests_per_s=cap * r,
        extra={"closed_loop": loop.regime, "cohorts": list(loop.cohorts), "scheduler": cfg.scheduler})


def _reported_steps(m: StepCosts, b: float) -> tuple[StepTime, StepTime]:
    """The decode step at batch `b` and the step carrying a prompt's (first) chunk beside those decodes."""
    cfg, spec, hw = m.cfg, m.spec, m.hw
    dec = step_time_shape(spec, hw, decode_shape(max(1, round(b)), m.ctx), tp=cfg.tp, dtype=cfg.dtype,
                          kv_dtype=cfg.kv_dtype, steps_per_dispatch=cfg.num_scheduler_steps,
                          overlapped=cfg.async_scheduling)
    q = min(m.budget(b), round(m.wl.computed_input))
    chunk_shape = prefill_shape(q, m.prefix)
    if round(b):
        chunk_shape = decode_shape(round(b), m.ctx) + chunk_shape
    return dec, step_time_shape(spec, hw, chunk_shape, tp=cfg.tp, dtype=cfg.dtype, kv_dtype=cfg.kv_dtype,
                                overlapped=cfg.async_scheduling)


def _samples(m: StepCosts, st: _State, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TTFT, TPOT (per request) and ITL (per gap) samples, seconds."""
    n = SAMPLES
    wl = m.wl
    out = wl.output_len
    s = wl.spread
    outs = np.maximum(1, np.round(out * rng.uniform(1 - s, 1 + s, n))) if s else np.full(n, float(out))
    scale = rng.uniform(1 - s, 1 + s, n) if s else np.ones(n)
    own = st.own_prefill * scale
    # Wait before its prefill starts: with probability rho the prefill server is busy and the wait is roughly
    # exponential (M/G/1 tail); otherwise only the residual of a decode step. The mean is the closed form's.
    p_busy = min(max(st.rho, 1e-6), 0.999)
    idle_mean = (st.t_d / 2) * (st.resid > 0)
    busy_mean = max(0.0, st.queue + st.resid - (1 - p_busy) * idle_mean) / p_busy
    busy = rng.random(n) < p_busy
    waits = np.where(busy, rng.exponential(busy_mean, n), rng.uniform(0, 2 * idle_mean, n))
    slot = rng.exponential(st.wait_slot, n) if st.wait_slot > 0 else 0.0
    ttft = own + waits + slot
    extra = max(st.tau - st.t_d, 0.0)
    deltas = np.array(st.chunk_deltas or [0.0])
    per_mixed = extra / st.f_mixed if st.f_mixed > 0 else 0.0
    deltas = deltas * (per_mixed / deltas.mean()) if deltas.mean() > 0 else deltas
    gaps = np.maximum(outs - 1, 1)
    k = rng.binomial(gaps.astype(int), st.f_mixed)
    tpot = st.t_d + k * per_mixed / gaps
    if st.tpot_extra > 0:  # the stall from prompts queued behind a request is spread over its own gaps
        tpot = tpot + rng.exponential(st.tpot_extra, n) * max(out - 1, 1) / gaps
    mixed = rng.random(n) < st.f_mixed
    itl = st.t_d + np.where(mixed, deltas[rng.integers(0, len(deltas), n)], 0.0)
    return ttft, tpot, itl


def predict_serving(spec: ModelSpec, hw: Hardware, workload: Workload, config: ServingConfig, *,
                    ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None,
                    memory: MemoryPlan | None = None, seed: int = 0) -> ServingPrediction:
    """Predict TTFT/TPOT/ITL, throughput and goodput for `workload` on `config` (closed form, all replicas).

    Raises `modelspec.memory.DoesNotFitError` if the model does not fit at this TP degree.
    """
    mem = memory or plan_memory(spec, hw.memory_bytes, tp=config.tp, dtype=config.dtype, kv_dtype=config.kv_dtype,
                                page_size=config.page_size, chunk_size=config.chunk_size,
                                max_num_seqs=config.max_num_seqs,
                                gpu_memory_utilization=config.gpu_memory_utilization)
    m = StepCosts(spec, hw, config, workload, mem)
    cap = max_rate(m)
    r = config.replicas
    if workload.closed_loop and workload.spread == 0:  # clients in waves (planner/closed_loop.py)
        return _lockstep_prediction(m, lockstep_loop(m, round(workload.concurrency / r)), cap, ttft_slo_ms,
                                    tpot_slo_ms)
    lam, st = _load(m, cap)
    b = st.batch if st.stable else m.slots
    dec, chunk = _reported_steps(m, b)
    common = dict(decode_step=dec, prefill_chunk_step=chunk, memory=mem, max_concurrency=m.slots,
                  capacity_requests_per_s=cap * r)
    if not st.stable:
        inf = Dist(math.inf, math.inf, math.inf, math.inf)
        return ServingPrediction(ttft=inf, tpot=inf, itl=inf, e2e_ms=math.inf, output_tokens_per_s=cap * r *
                                 workload.output_len, requests_per_s=cap * r, goodput_requests_per_s=0.0,
                                 stable=False, load=lam / cap if cap else math.inf, decode_batch=b, **common)
    ttft, tpot, itl = _samples(m, st, np.random.default_rng(seed))
    ok = np.ones(SAMPLES, dtype=bool)
    if ttft_slo_ms is not None:
        ok &= ttft * 1e3 <= ttft_slo_ms
    if tpot_slo_ms is not None:
        ok &= tpot * 1e3 <= tpot_slo_ms
    e2e = float(np.mean(ttft + tpot * max(workload.output_len - 1, 0)))
    return ServingPrediction(
        ttft=Dist.of(ttft), tpot=Dist.of(tpot), itl=Dist.of(itl), e2e_ms=e2e * 1e3,
        output_tokens_per_s=lam * r * workload.output_len, requests_per_s=lam * r,
        goodput_requests_per_s=lam * r * float(ok.mean()), stable=True, load=lam / cap if cap else math.inf,
        decode_batch=st.batch, extra={"prefill_utilization": st.rho, "mixed_step_fraction": st.f_mixed,
                                      "prefill_wait_ms": st.wait_prefill * 1e3, "slot_wait_ms": st.wait_slot * 1e3},
        **common)
