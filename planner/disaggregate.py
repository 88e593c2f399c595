"""Disaggregated serving: a prefill pool and a decode pool, with the KV cache moved between them.

Prefill instances are M/G/1 queues of whole prompts (no decodes share their steps); decode instances run
only decodes, with their batch from Little's law, B = lambda_d (O - 1) t_dec(B). Each request's KV cache
(all layers, all heads) crosses the link between the pools after its prefill: inside a node over NVLink/ICI
(one stream per TP rank), otherwise over the inter-node network. The split (instances x TP for each pool,
at most N devices) with the best goodput per device wins, and is compared with the best colocated config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from modelspec.memory import DoesNotFitError, kv_bytes_per_token, plan_memory
from modelspec.spec import ModelSpec
from planner.hardware import Hardware
from planner.search import tp_options
from planner.serving import SAMPLES, Dist, Workload
from planner.step_model import decode_shape, prefill_shape, step_time_shape


@dataclass
class DisaggPlan:
    """A prefill pool, a decode pool, and what they deliver."""

    prefill_instances: int
    prefill_tp: int
    decode_instances: int
    decode_tp: int
    kv_transfer_ms: float
    ttft: Dist
    tpot: Dist
    requests_per_s: float
    goodput_requests_per_s: float
    stable: bool

    @property
    def num_devices(self) -> int:
        return self.prefill_instances * self.prefill_tp + self.decode_instances * self.decode_tp

    @property
    def goodput_per_device(self) -> float:
        return self.goodput_requests_per_s / self.num_devices

    @property
    def pd_ratio(self) -> str:
        return f"{self.prefill_instances * self.prefill_tp}:{self.decode_instances * self.decode_tp}"


def kv_transfer_s(spec: ModelSpec, hw: Hardware, tokens: float, kv_dtype: str, tp_p: int, tp_d: int,
                  same_node: bool) -> float:
    """Seconds to move `tokens` tokens of KV cache (all layers and heads) from a prefill to a decode instance."""
    total = tokens * kv_bytes_per_token(spec, kv_dtype, tp=1)
    streams = min(tp_p, tp_d)
    bw = hw.intra_node_bw if same_node else hw.inter_node_bw
    return hw.allreduce_latency_s + total / (bw * streams)


class _Pools:
    def __init__(self, spec: ModelSpec, hw: Hardware, wl: Workload, dtype: str, kv_dtype: str | None,
                 page_size: int, util: float):
        self.spec, self.hw, self.wl = spec, hw, wl
        self.dtype, self.kv_dtype = dtype, kv_dtype or dtype
        self.page_size, self.util = page_size, util
        self.prefill_s = lru_cache(maxsize=None)(self._prefill_s)
        self.decode_step = lru_cache(maxsize=None)(self._decode_step)
        self.slots = lru_cache(maxsize=None)(self._slots)

    def _prefill_s(self, tp: int) -> float:
        wl = self.wl
        shape = prefill_shape(round(wl.computed_input), wl.input_len - round(wl.computed_input))
        return step_time_shape(self.spec, self.hw, shape, tp=tp, dtype=self.dtype, kv_dtype=self.kv_dtype).total_s

    def _decode_step(self, tp: int, batch: int) -> float:
        ctx = self.wl.input_len + self.wl.output_len / 2
        return step_time_shape(self.spec, self.hw, decode_shape(batch, ctx), tp=tp, dtype=self.dtype,
                               kv_dtype=self.kv_dtype).total_s

    def _slots(self, tp: int) -> int:
        mem = plan_memory(self.spec, self.hw.memory_bytes, tp=tp, dtype=self.dtype, kv_dtype=self.kv_dtype,
                          page_size=self.page_size, chunk_size=max(2048, self.wl.input_len), max_num_seqs=256,
                          gpu_memory_utilization=self.util)
        return mem.max_concurrency(self.wl.input_len + self.wl.output_len)

    def t_dec(self, tp: int, b: float) -> float:
        lo = max(1, int(b))
        t0 = self.decode_step(tp, lo)
        return t0 + max(0.0, b - lo) * (self.decode_step(tp, lo + 1) - t0)

    def evaluate(self, lam: float, n_p: int, tp_p: int, n_d: int, tp_d: int, same_node: bool,
                 ttft_slo_ms: float | None, tpot_slo_ms: float | None, seed: int = 0,
                 sample: bool = True) -> DisaggPlan:
        s = self.prefill_s(tp_p)
        xfer = kv_transfer_s(self.spec, self.hw, self.wl.input_len, self.kv_dtype, tp_p, tp_d, same_node)
        lam_p, lam_d = lam / n_p, lam / n_d
        rho = lam_p * s
        out = self.wl.output_len
        slots = self.slots(tp_d)

        def bad() -> DisaggPlan:
            inf = Dist(math.inf, math.inf, math.inf, math.inf)
            return DisaggPlan(n_p, tp_p, n_d, tp_d, xfer * 1e3, inf, inf, lam, 0.0, False)

        if rho >= 1 or slots < 1:
            return bad()
        wait = lam_p * s * s / (2 * (1 - rho))
        lo, hi = self.t_dec(tp_d, 1) * 0.5, self.t_dec(tp_d, slots) * 2
        if lam_d * (out - 1) * hi > slots:
            return bad()
        for _ in range(40):  # Little's law fixed point; a decode sees itself plus the batch (token-weighted B + 1)
            mid = 0.5 * (lo + hi)
            if self.t_dec(tp_d, min(slots, lam_d * (out - 1) * mid + 1)) > mid:
                lo = mid
            else:
                hi = mid
        tau = hi
        if not sample:  # means only (the closed-loop bisection)
            t, p = (s + xfer + wait) * 1e3, tau * 1e3
            return DisaggPlan(n_p, tp_p, n_d, tp_d, xfer * 1e3, Dist(t, t, t, t), Dist(p, p, p, p), lam, lam, True)
        rng = np.random.default_rng(seed)
        waits = np.where(rng.random(SAMPLES) < rho, rng.exponential(wait / max(rho, 1e-9), SAMPLES), 0.0)
        ttft = s + xfer + waits
        b = lam_d * (out - 1) * tau
        tpot = np.array([self.t_dec(tp_d, min(slots, max(1.0, x + 1)))
                         for x in rng.normal(b, math.sqrt(max(b, 1e-9)) / 4, 64)])
        tpot = rng.choice(tpot, SAMPLES)
        ok = np.ones(SAMPLES, dtype=bool)
        if ttft_slo_ms is not None:
            ok &= ttft * 1e3 <= ttft_slo_ms
        if tpot_slo_ms is not None:
            ok &= tpot * 1e3 <= tpot_slo_ms
        return DisaggPlan(n_p, tp_p, n_d, tp_d, xfer * 1e3, Dist.of(ttft), Dist.of(tpot), lam, lam * float(ok.mean()),
                          True)


@dataclass(frozen=True)
class PoolBalance:
    """What one prefill instance and one decode instance can each serve when kept busy, and how they compare.

    Capacities are requests/s of work a pool completes per second of being busy (no queueing): the prefill
    pool `1 / prefill_s`, the decode pool `B / (t_dec(B) (O - 1))` (the prefill pool draws the first token).
    """

    prefill_tp: int
    decode_tp: int
    input_len: int
    output_len: int
    decode_batch: float
    prefill_s: float  # one whole prompt, one step (the M/G/1 service time of `plan_disaggregated`)
    decode_step_s: float  # one decode step at `decode_batch` sequences of mean context input + output / 2
    kv_bytes_per_request: float  # KV moved per request: the prompt's, all layers, the model's own KV heads

    @property
    def prefill_rps(self) -> float:
        """Requests/s one prefill instance completes while busy."""
        return 1.0 / self.prefill_s

    @property
    def decode_rps(self) -> float:
        """Requests/s one decode instance completes while busy (inf when there is nothing to decode)."""
        steps = self.output_len - 1
        return math.inf if steps <= 0 else self.decode_batch / (self.decode_step_s * steps)

    @property
    def balance(self) -> float:
        """Prefill capacity / decode capacity of one instance each: > 1, the decode pool is the bottleneck."""
        return self.prefill_rps / self.decode_rps

    @property
    def balanced_pd(self) -> float:
        """Prefill devices per decode device at which both pools serve the same rate."""
        return (self.decode_rps / self.decode_tp) / (self.prefill_rps / self.prefill_tp)

    def requests_per_s(self, prefill_instances: int, decode_instances: int) -> float:
        """Rate the two pools sustain together: the slower pool's capacity."""
        return min(prefill_instances * self.prefill_rps, decode_instances * self.decode_rps)

    def split(self, num_devices: int) -> tuple[int, int]:
        """(prefill instances, decode instances) on at most `num_devices` devices with the highest rate.

        Ties go to fewer devices; (0, 0) when one instance of each does not fit.
        """
        best, key = (0, 0), (0.0, 0)
        for n_p in range(1, (num_devices - self.decode_tp) // self.prefill_tp + 1):
            n_d = (num_devices - n_p * self.prefill_tp) // self.decode_tp
            for d in range(1, n_d + 1):
                k = (self.requests_per_s(n_p, d), -(n_p * self.prefill_tp + d * self.decode_tp))
                if k > key:
                    best, key = (n_p, d), k
        return best


def pool_balance(spec: ModelSpec, hw: Hardware, input_len: int, output_len: int, *, prefill_tp: int = 1,
                 decode_tp: int = 1, decode_batch: float = 1.0, dtype: str = "bf16", kv_dtype: str | None = None,
                 prefix_hit: float = 0.0) -> PoolBalance:
    """Each pool's capacity and their balance, from the same step model and pool math `plan_disaggregated` uses.

    `decode_batch` (>= 1, fractional allowed: interpolated between whole batches) is the decode pool's mean
    sequences per step; `prefix_hit` the share of prompt tokens the prefill pool's prefix cache serves.
    """
    if decode_batch < 1:
        raise ValueError(f"decode_batch must be at least 1, got {decode_batch}")
    pools = _Pools(spec, hw, Workload(input_len, output_len, prefix_hit=prefix_hit), dtype, kv_dtype, 16, 0.9)
    return PoolBalance(prefill_tp=prefill_tp, decode_tp=decode_tp, input_len=input_len, output_len=output_len,
                       decode_batch=decode_batch, prefill_s=pools.prefill_s(prefill_tp),
                       decode_step_s=pools.t_dec(decode_tp, decode_batch),
                       kv_bytes_per_request=input_len * kv_bytes_per_token(spec, pools.kv_dtype, tp=1))


def plan_disaggregated(spec: ModelSpec, hw: Hardware, workload: Workload, num_devices: int, *,
                       dtype: str = "bf16", kv_dtype: str | None = None, page_size: int = 16,
                       gpu_memory_utilization: float = 0.9, ttft_slo_ms: float | None = None,
                       tpot_slo_ms: float | None = None) -> DisaggPlan | None:
    """Best prefill/decode split on at most `num_devices` devices (None if no split fits or N < 2).

    With `workload.concurrency`, the rate is found from lambda * E2E(lambda) = concurrency.
    """
    pools = _Pools(spec, hw, workload, dtype, kv_dtype, page_size, gpu_memory_utilization)
    tps = []
    for t in tp_options(spec, num_devices):
        try:
            if pools.slots(t) >= 1:
                tps.append(t)
        except DoesNotFitError:
            continue
    same_node = num_devices <= hw.devices_per_node
    best: DisaggPlan | None = None
    for tp_p in tps:
        for tp_d in tps:
            for n_p in range(1, (num_devices - tp_d) // tp_p + 1):
                n_d_max = (num_devices - n_p * tp_p) // tp_d
                for n_d in range(1, n_d_max + 1):
                    plan = _at_load(pools, workload, n_p, tp_p, n_d, tp_d, same_node, ttft_slo_ms, tpot_slo_ms)
                    if plan.stable and (best is None or (plan.goodput_per_device, -plan.ttft.mean) >
                                        (best.goodput_per_device, -best.ttft.mean)):
                        best = plan
    return best


def _at_load(pools: _Pools, wl: Workload, n_p: int, tp_p: int, n_d: int, tp_d: int, same_node: bool,
             ttft_slo: float | None, tpot_slo: float | None) -> DisaggPlan:
    if wl.concurrency is None:
        lam = wl.request_rate if wl.request_rate is not None else 1.0
        return pools.evaluate(lam, n_p, tp_p, n_d, tp_d, same_node, ttft_slo, tpot_slo)
    lo, hi = 0.0, n_p / pools.prefill_s(tp_p)
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        p = pools.evaluate(mid, n_p, tp_p, n_d, tp_d, same_node, ttft_slo, tpot_slo, sample=False)
        e2e = (p.ttft.mean + p.tpot.mean * (wl.output_len - 1)) / 1e3 if p.stable else math.inf
        if mid * e2e < wl.concurrency:
            lo = mid
        else:
            hi = mid
    return pools.evaluate(max(lo, 1e-9), n_p, tp_p, n_d, tp_d, same_node, ttft_slo, tpot_slo)
