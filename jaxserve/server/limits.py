"""What one server accepts: `ServerLimits` (the `jaxserve serve` flags of docs/server.md) and admission.

Every bound here is checked before the work it bounds: the prompt count from the raw JSON before pydantic
walks the prompts, the waiting bound before anything is tokenized.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxserve.server.errors import APIError

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on clients; None or 0 disables the ones documented so.

    `max_prompts_per_request` bounds prompts x n (the engine sequences one request becomes);
    `max_num_waiting` bounds admitted sequences beyond the engine's `max_num_seqs` (429 past it);
    `request_timeout` is seconds from arrival to the last token (None: none); `stream_buffer_tokens` is how far
    the engine may run ahead of a stream's reader before the request is aborted (0: no bound);
    `request_read_timeout` is the seconds a client has to send a request's headers and body;
    `structured_outputs_cache_bytes` bounds the compiled grammars kept (one grammar may take a quarter of it) and
    `structured_outputs_compile_timeout` the seconds one grammar may take to compile (structured/compiler.py).
    """

    api_keys: tuple[str, ...] = ()
    max_request_body_bytes: int = 2 * 2**20
    max_prompts_per_request: int = 256
    max_num_waiting: int | None = 1024
    request_timeout: float | None = None
    stream_buffer_tokens: int = 2048
    request_read_timeout: float = 30.0
    structured_outputs_cache_bytes: int = 64 * 2**20
    structured_outputs_compile_timeout: float = 10.0
    max_logprobs: int = 20  # vLLM's --max-logprobs: alternatives a request may ask for per token

    def __post_init__(self) -> None:
        if any(not k for k in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must not be negative, got {self.max_logprobs}")
        for name in ("max_request_body_bytes", "max_prompts_per_request", "structured_outputs_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("request_timeout", "request_read_timeout", "structured_outputs_compile_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.stream_buffer_tokens < 0 or (self.max_num_waiting or 0) < 0:
            raise ValueError("stream_buffer_tokens and max_num_waiting must not be negative")


def _prompt_count(obj: dict[str, Any]) -> int:
    """Prompts in a raw completions body (1 for chat): a list of strings or of id lists, else one prompt."""
    p = obj.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], str | list):
        return len(p)
    return 1


def check_request_shape(obj: dict[str, Any], limits: ServerLimits, max_model_len: int) -> None:
    """400 when a raw request body asks for more than max_prompts_per_request sequences (prompts x n), or
    holds a prompt of more token ids than the context: both before pydantic walks the prompts."""
    prompts = _prompt_count(obj)
    n = obj.get("n")
    n = n if type(n) is int and n > 0 else 1  # a bad n is reported by validation, with its own message
    if prompts * n > limits.max_prompts_per_request:
        raise APIError(400, f"This request asks for {prompts} prompt(s) x n={n} = {prompts * n} sequences; this "
                            f"server allows at most {limits.max_prompts_per_request} per request",
                       "prompt" if prompts > 1 else "n", "too_many_prompts")
    p = obj.get("prompt")
    lists = [p] if isinstance(p, list) and p and not isinstance(p[0], list) else p if isinstance(p, list) else []
    longest = max((len(x) for x in lists if isinstance(x, list)), default=0)
    if longest > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, the prompt "
                            f"has {longest} tokens. Please reduce the length of the prompt.", "prompt",
                       "context_length_exceeded")


class Admission:
    """Engine sequences admitted and not yet finished, bounded by `capacity` (None: no bound).

    A request that would take the count past capacity is refused with 429 and Retry-After, as TGI does when
    overloaded; one request is always admitted into an idle server, however large.
    """

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.admitted = 0

    def reserve(self, count: int) -> Callable[[], None]:
        """Admit `count` sequences or raise APIError(429); returns the (idempotent) release."""
        if self.capacity is not None and self.admitted and self.admitted + count > self.capacity:
            raise APIError(429, f"The server is overloaded: {self.admitted} sequences are already admitted "
                                f"(at most {self.capacity}); retry later", None, "server_overloaded",
                           type_="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.admitted += count
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.admitted -= count

        return release
