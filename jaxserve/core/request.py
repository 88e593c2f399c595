"""A request's lifetime state, shared by the scheduler, the KV-cache manager and the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from jaxserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """One sequence being served. Times are from the engine's monotonic clock (seconds)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    cache_salt: str | None = None
    max_tokens: int = 16  # resolved from sampling_params and max_model_len at submission
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission (None until admitted)
    page_ids: list[int] = field(default_factory=list)  # block table, one page per page_size tokens
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    grammar: Any = None  # structured outputs: its matcher (jaxserve/structured/grammar.py), fed the output ids
    # Speculative decoding: tokens proposed for the next step (verified after the last token), and totals so far.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_num_steps: int = 0  # steps that verified at least one proposed token
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_owed(self) -> int:
        """Tokens whose KV still has to be computed before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished
