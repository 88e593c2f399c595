"""`--speculative-config`: vLLM's JSON object, parsed once into a dataclass that the engine config holds."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How tokens are proposed and how many a sequence verifies per step (vLLM's field names).

    ngram: the longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min tokens) found earlier in the
    sequence proposes the tokens that followed it. draft_model: `model` (a preset or checkpoint with the target's
    vocabulary) proposes k tokens autoregressively, on its own KV pool.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config: method 'ngram' takes no model")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"speculative_config: {name} must be a positive integer, got {v!r}")
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config: method 'draft_model' needs \"model\" (a preset or checkpoint)")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("speculative_config: prompt_lookup_min/max belong to method 'ngram'")


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A JSON string (the CLI flag), a dict (`LLM(speculative_config={...})`) or a config; ValueError (one line)
    on bad JSON, unknown fields or bad values."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e.msg} (char {e.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(known))})")
    if "method" not in value:
        raise ValueError("speculative_config needs \"method\" (ngram or draft_model)")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs \"num_speculative_tokens\"")
    return SpeculativeConfig(**value)
