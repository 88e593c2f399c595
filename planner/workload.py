"""What is served and how: the workload, one deployment's knobs, and a latency distribution summary."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    """Requests: lengths, prefix-cache hit ratio, and how they are sent (totals over all replicas), as `vllm bench
    serve` sends them: a `request_rate` of gamma-distributed gaps (shape `burstiness`; 1 is Poisson), at most
    `concurrency` in flight; `concurrency` alone is a closed loop (each client sends its next request when its
    last one ends), and both together a jittered closed loop. `num_prompts`: the run's length, whose first wave
    (every client at once) the predictions then include, as a benchmark run measures it; None: steady state."""

    input_len: int = 1024
    output_len: int = 256
    spread: float = 0.0  # lengths uniform in [L(1-spread), L(1+spread)]
    prefix_hit: float = 0.0  # fraction of prompt tokens served from the prefix cache
    request_rate: float | None = None  # req/s over all replicas
    concurrency: float | None = None  # clients over all replicas
    burstiness: float = 1.0  # gamma shape of the gaps between sends (vLLM's --burstiness)
    num_prompts: int | None = None  # requests in the run (None: the steady state)

    def __post_init__(self) -> None:
        if self.input_len <= 0 or self.output_len <= 0:
            raise ValueError("input and output lengths must be positive")
        if not 0 <= self.spread < 1 or not 0 <= self.prefix_hit < 1:
            raise ValueError("spread and prefix_hit must be in [0, 1)")
        if (self.request_rate is not None and self.request_rate <= 0) or (
                self.concurrency is not None and self.concurrency <= 0):
            raise ValueError("request rate and concurrency must be positive")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be at least 1, got {self.num_prompts}")

    @property
    def closed_loop(self) -> bool:
        """Clients only: each sends its next request the moment its last one ends."""
        return self.concurrency is not None and self.request_rate is None

    @property
    def computed_input(self) -> float:
        """Prompt tokens that must be computed (the last prompt token always is)."""
        return max(1.0, self.input_len * (1 - self.prefix_hit))


SCHEDULERS = ("mixed", "prefill-first")


@dataclass(frozen=True)
class ServingConfig:
    """One deployment: TP degree, replicas and scheduler knobs."""

    tp: int = 1
    replicas: int = 1
    max_num_seqs: int = 256
    chunk_size: int = 2048  # max_num_batched_tokens per step
    page_size: int = 16
    dtype: str = "bf16"
    kv_dtype: str | None = None
    gpu_memory_utilization: float = 0.9
    token_buckets: tuple[int, ...] = ()  # the runtime's token padding ladder; () = no padding
    num_scheduler_steps: int = 1  # decode steps per dispatch while every running request decodes
    async_scheduling: bool = False  # the overlapped loop: each step's host work beside the previous step's device
    # How a step mixes work (SCHEDULERS): "mixed" carries every running decode and then prefill chunks within the
    # budget (vLLM V1, vLLM V0 with chunked prefill, TensorRT-LLM's in-flight batching, jaxserve); "prefill-first"
    # runs waiting prompts in steps of their own while the decodes wait (vLLM V0 without chunked prefill,
    # SGLang's default), so a closed loop's clients stay in one wave.
    scheduler: str = "mixed"

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; choose from {', '.join(SCHEDULERS)}")

    @property
    def num_devices(self) -> int:
        return self.tp * self.replicas


@dataclass(frozen=True)
class Dist:
    """Mean and percentiles of a latency, in milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, samples_s: np.ndarray) -> Dist:
        ms = np.asarray(samples_s) * 1e3
        if ms.size == 0 or not np.all(np.isfinite(ms)):
            return cls(math.inf, math.inf, math.inf, math.inf)
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(float(ms.mean()), float(p50), float(p90), float(p99))

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "p50": self.p50, "p90": self.p90, "p99": self.p99}
