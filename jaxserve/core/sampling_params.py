"""Per-request sampling and stopping parameters, vLLM-compatible names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The sampler keeps a seed in 32 bits (runner/sampler.py): a seed outside [0, 2**32) would collide with one
# inside, so it is refused rather than cut. Integer fields go into int32 device arrays.
SEED_RANGE = 2**32
INT32_MAX = 2**31 - 1


def _finite(x: float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 is greedy; top_k <= 0 and top_p = 1 and min_p = 0 disable those filters. `seed` (in [0, 2**32))
    makes a request's samples reproducible whatever else shares its batch. `logprobs` asks for that many top
    alternatives' log-probabilities per generated token (0 = only the chosen token's).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field (its name is the message's first word)."""
        for name in ("temperature", "top_p", "min_p"):
            if not _finite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be in [-1, {INT32_MAX}] (-1 or 0 disables), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < SEED_RANGE:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        bad = next((t for t in self.stop_token_ids if not 0 <= t <= INT32_MAX), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids must be in [0, {INT32_MAX}], got {bad}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
