"""What the engine hands back: per-request outputs with timing, and per-step statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timestamps (engine monotonic clock, seconds) and derived latencies of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding: steps that verified proposed tokens, tokens proposed, tokens accepted.
    spec_num_steps: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed tokens (vLLM's draft acceptance rate); None without proposals."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens a verify step emitted on average: 1 + accepted per step (vLLM's mean acceptance length)."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_steps if self.spec_num_steps else None

    @property
    def ttft(self) -> float | None:
        """Arrival to first token: queueing plus prefill."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None with fewer than two tokens."""
        if self.finish_time is None or self.first_token_time is None or len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.first_token_time) / (len(self.token_times) - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None:
            return None
        return self.finish_time - self.first_token_time


@dataclass
class CompletionOutput:
    """One generated sequence. `logprobs`, when asked for, holds per token {token_id: logprob}."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """The state of one request: cumulative text and tokens so far, `finished` on the last one.

    `prompt_logprobs` (when `SamplingParams.prompt_logprobs` is set): None for the first prompt token, then per
    prompt token {token_id: logprob} with that token and the top-k alternatives (runner/prompt_logprobs.py).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class StepStats:
    """What one engine step did, for metrics and logs."""

    time: float
    duration: float
    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float  # in-use pages / usable pages (cached-unlocked pages count as free)
    num_preemptions: int  # in this step
    prefix_queries: int  # prompt tokens looked up in the prefix cache in this step
    prefix_hits: int  # of those, tokens served from cache
    decode_context_tokens: int = 0  # sum of the decodes' KV lengths (the attention a step reads)
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)  # (chunk tokens, tokens before it)
    compiled: bool = False  # the step compiled a new variant (never after warm-up)
    num_prompts_done: int = 0  # prefill rows whose prompt finished in this step (each drew its first token)
