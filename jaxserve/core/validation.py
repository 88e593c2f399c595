"""The one check of a prompt and its completion budget, shared by the engine, the scheduler and the server.

Every failure is a `PromptError` (a ValueError) whose message is ready for a client and whose `code` is the
OpenAI error code the server answers with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class PromptError(ValueError):
    """A prompt that can never be served as asked."""

    def __init__(self, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.code = code


def context_length_error(max_model_len: int, prompt_len: int, max_tokens: int) -> str:
    """vLLM's wording, which clients match on."""
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.")


def check_token_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """The ids as ints; PromptError naming the first one outside [0, vocab_size)."""
    ids = [int(t) for t in ids]
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise PromptError(f"Token id {bad} is out of vocabulary (size {vocab_size})")
    return ids


def encode_prompt(prompt: str | Sequence[int], tokenizer: Any, vocab_size: int,
                  add_special_tokens: bool = True) -> list[int]:
    """Token ids of a prompt given as text (needs a tokenizer) or as ids (checked against the vocabulary)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise PromptError("This model has no tokenizer; send the prompt as token ids")
        ids = list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    else:
        ids = check_token_ids(prompt, vocab_size)
    if not ids:
        raise PromptError("The prompt is empty")
    return ids


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int) -> int:
    """The completion budget: `requested`, or the rest of the context when None; PromptError unless it fits."""
    if prompt_len == 0:
        raise PromptError("The prompt is empty")
    if requested is not None and requested < 1:
        raise PromptError(f"max_tokens must be at least 1, got {requested}")
    budget = requested if requested is not None else max_model_len - prompt_len
    if budget < 1 or prompt_len + budget > max_model_len:
        raise PromptError(context_length_error(max_model_len, prompt_len, max(budget, 0)), "context_length_exceeded")
    return budget
