"""OpenAI-compatible request and response models for the HTTP server.

Requests are validated strictly: wrong JSON types are rejected (no "5" -> 5 coercion) and unknown fields
are rejected, so a parameter we do not implement is a 400 naming it rather than silently ignored. A few
OpenAI parameters that clients commonly send at their neutral value (penalties of 0, `echo: false`, empty
`logit_bias`, ...) are accepted only at that value. `user` is accepted: it is an end-user identifier that
does not change the output.

Lists validate fail-fast (the first bad element ends validation: a million bad entries cost one error, not a
million), free-form fields are not walked, and stop strings are bounded in number and length (each is
searched after every token).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxserve.core.sampling_params import SEED_RANGE, SamplingParams
from jaxserve.server.errors import excerpt

_STRICT = ConfigDict(strict=True, extra="forbid")
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 32, 1024, 1024
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class UnsupportedValue(ValueError):
    """A parameter given a value we do not implement (or an invalid one); `param` names it."""

    def __init__(self, param: str, message: str, code: str = "unsupported_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def _neutral_only(req: BaseModel, neutral: dict[str, Any]) -> None:
    """Raise UnsupportedValue for a field set away from its only supported (neutral) value."""
    for name, ok in neutral.items():
        value = getattr(req, name)
        if value is not None and not ok(value):
            raise UnsupportedValue(name, f"Unsupported value for '{name}': {excerpt(value)} (jaxserve does not "
                                         "implement it)")


_PENALTIES = {
    "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0,
    "repetition_penalty": lambda v: v == 1,
    "logit_bias": lambda v: not v,
}


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _STRICT

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None  # only {} is supported: its entries are never looked at

    def check_supported(self) -> None:
        """Reject supported-looking parameters set to values we do not implement."""
        _neutral_only(self, _PENALTIES)
        if self.stream_options is not None and not self.stream:
            raise UnsupportedValue("stream_options", "stream_options is only allowed when stream is true")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, seed: int | None) -> SamplingParams:
        """The engine's SamplingParams; raises ValueError naming an invalid field."""
        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return SamplingParams(n=1, max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
                              seed=seed, ignore_eos=self.ignore_eos, logprobs=logprobs,
                              include_stop_str_in_output=self.include_stop_str_in_output, **kw)

    def validate_values(self) -> None:
        """Check value ranges before anything is tokenized (SamplingParams names the field)."""
        self.check_supported()
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UnsupportedValue("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}",
                                   "invalid_value")
        if not 1 <= self.n <= 64:
            raise UnsupportedValue("n", f"n must be in [1, 64], got {excerpt(self.n)}", "invalid_value")
        if self.seed is not None and 0 <= self.seed < SEED_RANGE <= self.seed + self.n - 1:
            raise UnsupportedValue("seed", f"seed + n - 1 must be below 2**32 (choice i uses seed + i), got seed "
                                           f"{self.seed} with n {self.n}", "invalid_value")
        self.sampling_params(self.max_tokens, None, self.seed)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: (str | Annotated[list[str], Field(fail_fast=True)] | Annotated[list[int], Field(fail_fast=True)]
             | Annotated[list[Annotated[list[int], Field(fail_fast=True)]], Field(fail_fast=True)])
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        _neutral_only(self, {"echo": lambda v: v is False, "suffix": lambda v: v == "",
                             "best_of": lambda v: v in (1, self.n)})

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise UnsupportedValue("prompt", "prompt must not be empty", "invalid_value")
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "developer"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[list[dict[str, Any]], Field(fail_fast=True)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _merge_max_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def check_supported(self) -> None:
        super().check_supported()
        _neutral_only(self, {"tools": lambda v: not v, "tool_choice": lambda v: v == "none",
                             "response_format": lambda v: v == {"type": "text"}})
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise UnsupportedValue("top_logprobs", "top_logprobs requires logprobs to be true")
            if not 0 <= self.top_logprobs <= 20:
                raise UnsupportedValue("top_logprobs", f"top_logprobs must be in [0, 20], got {self.top_logprobs}",
                                       "invalid_value")

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as plain {role, content} dicts for the chat template."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(BaseModel):
    """POST /tokenize: either `prompt` or `messages`."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(fail_fast=True)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int] = Field(fail_fast=True)


# ---- responses (serialized with model_dump(exclude_none=False); extra fields are OpenAI's) ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
