"""Configuration search: TP degree, replicas, max_num_seqs and chunk size for N devices.

TP degrees divide N and the attention heads (KV heads divide TP or TP divides them: replication); replicas
= N / TP. Each knob the user gave is held fixed. The score is goodput per device under the SLOs, or
throughput per device when no SLO is given; ties (e.g. every config sustains a fixed request rate) go to the
lower mean end-to-end latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modelspec.memory import DoesNotFitError
from modelspec.spec import ModelSpec
from planner.hardware import Hardware
from planner.serving import ServingConfig, ServingPrediction, Workload, predict_serving

MAX_NUM_SEQS_GRID = (16, 32, 64, 128, 256, 512)
CHUNK_GRID = (256, 512, 1024, 2048, 4096, 8192)


class ConfigError(ValueError):
    """A knob that cannot work for this model or device count."""


@dataclass
class Candidate:
    """One evaluated configuration and its prediction."""

    config: ServingConfig
    prediction: ServingPrediction

    @property
    def num_devices(self) -> int:
        return self.config.num_devices

    @property
    def score(self) -> tuple[float, float]:
        p = self.prediction
        if not p.stable:  # overloaded: rank by sustainable rate per device
            return (-1.0, p.capacity_requests_per_s / self.num_devices)
        return (p.goodput_requests_per_s / self.num_devices, -(p.e2e_ms if math.isfinite(p.e2e_ms) else 1e18))

    def summary(self) -> dict[str, float | int | bool]:
        p, c = self.prediction, self.config
        return {"tp": c.tp, "replicas": c.replicas, "max_num_seqs": c.max_num_seqs, "chunk_size": c.chunk_size,
                "stable": p.stable, "ttft_ms_mean": p.ttft.mean, "tpot_ms_mean": p.tpot.mean,
                "itl_ms_p99": p.itl.p99, "requests_per_s": p.requests_per_s,
                "goodput_requests_per_s": p.goodput_requests_per_s,
                "goodput_per_device": p.goodput_requests_per_s / self.num_devices, "load": p.load}


def valid_tp(spec: ModelSpec, tp: int, num_devices: int) -> str | None:
    """None if `tp` works for `spec` on `num_devices` devices, else the reason it does not."""
    if tp < 1:
        return f"tp must be positive, got {tp}"
    if num_devices % tp:
        return f"tp={tp} does not divide --num-devices {num_devices}"
    if spec.num_heads % tp:
        return f"tp={tp} does not divide the {spec.num_heads} attention heads of {spec.name}"
    kv = spec.num_kv_heads
    if not spec.is_mla and kv % tp and tp % kv:
        return f"tp={tp} neither divides nor is a multiple of the {kv} KV heads of {spec.name}"
    return None


def tp_options(spec: ModelSpec, num_devices: int) -> list[int]:
    """TP degrees that divide the device count and the heads."""
    return [t for t in range(1, num_devices + 1) if valid_tp(spec, t, num_devices) is None]


def search(spec: ModelSpec, hw: Hardware, workload: Workload, num_devices: int, *, tp: int | None = None,
           max_num_seqs: int | None = None, chunk_size: int | None = None, page_size: int = 16,
           dtype: str = "bf16", kv_dtype: str | None = None, gpu_memory_utilization: float = 0.9,
           ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None,
           num_scheduler_steps: int = 1, scheduler: str = "mixed",
           async_scheduling: bool = False) -> list[Candidate]:
    """Evaluate configurations and return them best first (coordinate search: seqs, then chunk).

    Raises `ConfigError` for a TP that cannot work and `DoesNotFitError` if no configuration fits.
    """
    if tp is not None:
        why = valid_tp(spec, tp, num_devices)
        if why:
            raise ConfigError(why)
        tps = [tp]
    else:
        tps = tp_options(spec, num_devices)
        if not tps:
            raise ConfigError(f"no TP degree divides both --num-devices {num_devices} and the heads of {spec.name}")
    seqs_grid = (max_num_seqs,) if max_num_seqs else MAX_NUM_SEQS_GRID
    chunk_grid = (chunk_size,) if chunk_size else CHUNK_GRID
    out: list[Candidate] = []
    last_error: DoesNotFitError | None = None

    def evaluate(t: int, seqs: int, chunk: int) -> Candidate | None:
        nonlocal last_error
        cfg = ServingConfig(tp=t, replicas=num_devices // t, max_num_seqs=seqs, chunk_size=chunk,
                            page_size=page_size, dtype=dtype, kv_dtype=kv_dtype,
                            gpu_memory_utilization=gpu_memory_utilization, num_scheduler_steps=num_scheduler_steps,
                            scheduler=scheduler, async_scheduling=async_scheduling)
        try:
            pred = predict_serving(spec, hw, workload, cfg, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms)
        except DoesNotFitError as e:
            last_error = e
            return None
        cand = Candidate(cfg, pred)
        out.append(cand)
        return cand

    for t in tps:
        base_chunk = chunk_size or 2048
        by_seqs = [c for s in seqs_grid if (c := evaluate(t, s, base_chunk)) is not None]
        if not by_seqs:
            continue
        best = max(by_seqs, key=lambda c: c.score)
        for ch in chunk_grid:
            if ch != base_chunk:
                evaluate(t, best.config.max_num_seqs, ch)
    if not out:
        raise last_error or DoesNotFitError(f"{spec.name} does not fit on {num_devices} x {hw.name}")
    out.sort(key=lambda c: c.score, reverse=True)
    return out
