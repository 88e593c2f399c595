"""OpenAI-compatible request and response models for the HTTP server.

Lenient on what clients add, strict on what matters (vLLM's behaviour): unknown fields are accepted and
`ignored_fields` names them for a one-line warning, while wrong JSON types are rejected (no "5" -> 5
coercion; a whole-number float such as 5.0 is accepted for an integer field, 5.5 is not). A parameter we know
but do not implement (`suffix`, `best_of`) is accepted only at its neutral value, else a 400 naming it.
`user` is accepted: it is an end-user identifier that does not change the output.

Lists validate fail-fast (the first bad element ends validation: a million bad entries cost one error, not a
million), free-form fields are not walked, and stop strings are bounded in number and length (each is
searched after every token).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from jaxserve.core.sampling_params import MAX_BAD_WORDS, MAX_LOGIT_BIAS, SEED_RANGE, SamplingParams
from jaxserve.server.errors import UnsupportedValue, excerpt
from jaxserve.server.structured_fields import structured_outputs
from jaxserve.structured.tools import ToolsError, check_tool_calls, check_tools, template_messages

_STRICT = ConfigDict(strict=True, extra="allow")  # extras are kept so that ignored_fields can name them
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 32, 1024, 1024
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
MAX_IGNORED_NAMES = 8
MAX_ARGUMENTS_DEPTH = 64  # a past tool call's JSON arguments, parsed for the chat template


def _whole(value: Any) -> Any:
    """5.0 -> 5: JSON has one number type and some clients write every number as a float; 5.5 stays a float
    (and fails the strict int check), as do bools."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole)]


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields `model` (and the models inside it) received but does not define, at most
    MAX_IGNORED_NAMES of them."""
    names = [prefix + str(k) for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if len(names) >= MAX_IGNORED_NAMES:
                return names[:MAX_IGNORED_NAMES]
            if isinstance(item, BaseModel):
                at = f"{name}[{i}]" if isinstance(value, list) else name
                names += ignored_fields(item, f"{prefix}{at}.")
    return names[:MAX_IGNORED_NAMES]


def _neutral_only(req: BaseModel, neutral: dict[str, Any]) -> None:
    """Raise UnsupportedValue for a field set away from its only supported (neutral) value."""
    for name, ok in neutral.items():
        value = getattr(req, name)
        if value is not None and not ok(value):
            raise UnsupportedValue(name, f"Unsupported value for '{name}': {excerpt(value)} (jaxserve does not "
                                         "implement it)")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk, not only the last


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _STRICT

    model: str | None = None
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    max_tokens: Int | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)] | None = None
    stop_token_ids: Annotated[list[Int], Field(max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)] | None = None
    seed: Int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: Int = 0
    prompt_logprobs: Int | None = None  # vLLM's: each prompt token's logprob and that many alternatives
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS, fail_fast=True)] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(fail_fast=True)] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        """Reject supported-looking parameters set to values we do not implement."""
        if self.stream_options is not None and not self.stream:
            raise UnsupportedValue("stream_options", "stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:  # vLLM's rule too
            raise UnsupportedValue("prompt_logprobs", "prompt_logprobs is not available when streaming")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, seed: int | None,
                        constraint: Any = ...) -> SamplingParams:
        """The engine's SamplingParams; raises ValueError naming an invalid field. `constraint` is the request's
        structured output constraint when already built (`structured_outputs(self, max_tokens)` otherwise)."""
        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.prompt_logprobs_k() is not None:
            kw["prompt_logprobs"] = self.prompt_logprobs_k()
        return SamplingParams(n=1, max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
                              seed=seed, ignore_eos=self.ignore_eos, logprobs=logprobs,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              logit_bias=self.token_bias(), min_tokens=self.min_tokens, bad_words=self.bad_words,
                              structured_outputs=structured_outputs(self, max_tokens) if constraint is ...
                              else constraint, **kw)

    def prompt_logprobs_k(self) -> int | None:
        return self.prompt_logprobs

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys (JSON strings) as token ids."""
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise UnsupportedValue("logit_bias", "logit_bias keys must be token ids (integers as strings)",
                                   "invalid_value") from None

    def validate_values(self) -> None:
        """Check value ranges before anything is tokenized (SamplingParams names the field)."""
        self.check_supported()
        echo = "echo" in type(self).model_fields and self.echo  # completions' (a chat extra is ignored)
        least = 0 if echo else 1  # echo with max_tokens 0: the prompt alone (lm-eval)
        if self.max_tokens is not None and self.max_tokens < least:
            raise UnsupportedValue("max_tokens", f"max_tokens must be at least {least}, got {self.max_tokens}",
                                   "invalid_value")
        if not 1 <= self.n <= 64:
            raise UnsupportedValue("n", f"n must be in [1, 64], got {excerpt(self.n)}", "invalid_value")
        if self.seed is not None and 0 <= self.seed < SEED_RANGE <= self.seed + self.n - 1:
            raise UnsupportedValue("seed", f"seed + n - 1 must be below 2**32 (choice i uses seed + i), got seed "
                                           f"{self.seed} with n {self.n}", "invalid_value")
        self.sampling_params(self.max_tokens or 1, None, self.seed, structured_outputs(self, None))


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: (str | Annotated[list[str], Field(fail_fast=True)] | Annotated[list[int], Field(fail_fast=True)]
             | Annotated[list[Annotated[list[int], Field(fail_fast=True)]], Field(fail_fast=True)])
    logprobs: Int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: Int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        _neutral_only(self, {"suffix": lambda v: v == "", "best_of": lambda v: v in (1, self.n)})

    def prompt_logprobs_k(self) -> int | None:
        """Prompt logprobs the engine computes: for `echo` with `logprobs`, and for `prompt_logprobs`."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None

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
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message's: which call it answers
    tool_calls: Annotated[list[dict[str, Any]], Field(fail_fast=True)] | None = None  # an assistant message's

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: role (developer is system), content, and what else is set."""
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        for key in ("name", "tool_call_id", "tool_calls"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: Annotated[list[dict[str, Any]], Field(fail_fast=True)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call under tool_choice "required"

    @model_validator(mode="after")
    def _merge_max_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def check_supported(self) -> None:
        super().check_supported()
        try:
            check_tools(self.tools, self.tool_choice)
            for i, m in enumerate(self.messages):
                if m.tool_calls:
                    check_tool_calls(m.tool_calls, f"messages[{i}].tool_calls", MAX_ARGUMENTS_DEPTH)
        except ToolsError as e:
            raise UnsupportedValue(e.param, str(e), "invalid_value") from None
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise UnsupportedValue("top_logprobs", "top_logprobs requires logprobs to be true")
            if not 0 <= self.top_logprobs <= 20:
                raise UnsupportedValue("top_logprobs", f"top_logprobs must be in [0, 20], got {self.top_logprobs}",
                                       "invalid_value")

    def chat_messages(self, template: str | None = None) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template `template` (the tools too, when it ignores them)."""
        return template_messages([m.template_dict() for m in self.messages], self.tools, template)

    @property
    def effective_tool_choice(self) -> Any:
        """OpenAI's default: "auto" with tools, "none" without."""
        return self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")


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
