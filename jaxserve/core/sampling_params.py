"""Per-request sampling and stopping parameters, vLLM-compatible names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# The sampler keeps a seed in 32 bits (runner/sampler.py): a seed outside [0, 2**32) would collide with one
# inside, so it is refused rather than cut. Integer fields go into int32 device arrays.
SEED_RANGE = 2**32
INT32_MAX = 2**31 - 1
MAX_LOGIT_BIAS = 300  # entries; the sampler's bias input has this fixed width
MAX_BAD_WORDS = 128
# Values that float32 cannot carry are clamped to what they mean (vLLM's _SAMPLING_EPS for temperature): a
# temperature this small is greedy; a top_p this small keeps only the most likely token (for any vocabulary
# below 1e8), as 1e-300 means, where float32 would make it 0 and keep nothing; a repetition_penalty this small
# already makes a seen token win, while 1e-300 in float32 is 0 and divides logits by zero.
MIN_TEMPERATURE, MIN_TOP_P, MIN_REPETITION_PENALTY, MIN_MIN_P = 1e-5, 1e-8, 1e-6, 1e-8


def _finite(x: float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's `structured_outputs`): exactly one of a JSON schema (text or dict), any
    JSON object, a regular expression, a choice among strings, or a grammar (Lark or GBNF). jaxserve/structured
    compiles it into a token mask per step."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # Set by the server once it has compiled the constraint out of process (structured/compiler.py): the engine
    # copies it instead of compiling. Not part of the constraint's identity.
    compiled: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, json_object, regex, choice or grammar, "
                             f"got {', '.join(given) or 'none'}")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs choice must hold at least one string")


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 is greedy; top_k <= 0 and top_p = 1 and min_p = 0 disable those filters. `seed` (in [0, 2**32))
    makes a request's samples reproducible whatever else shares its batch. `logprobs` asks for that many top
    alternatives' log-probabilities per generated token (0 = only the chosen token's). `prompt_logprobs` (vLLM's
    meaning) asks for each prompt token's own logprob and that many top alternatives' (None = off); they come back
    as `RequestOutput.prompt_logprobs` (contract: jaxserve/runner/prompt_logprobs.py).

    Logits processing, as vLLM defines it (runner/logits_processing.py), before temperature and the filters:
    `bad_words` (each word's last token banned where the output ends in the rest of it; `update_from_tokenizer`
    tokenizes them), `min_tokens` (EOS and stop ids banned, stop strings unchecked, before that many tokens),
    `logit_bias` (token id -> bias, clamped to [-100, 100]), then `repetition_penalty` (prompt and output tokens:
    positive logits divided by it, negative ones multiplied), `frequency_penalty` (times each output token's
    count, subtracted) and `presence_penalty` (subtracted once per output token seen).
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
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)  # set by update_from_tokenizer
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()
        self._clamp()

    def _clamp(self) -> None:
        """Move values below what float32 carries to their meaning (see MIN_TEMPERATURE)."""
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        self.top_p = max(self.top_p, MIN_TOP_P)
        self.min_p = 0.0 if self.min_p < MIN_MIN_P else self.min_p
        self.repetition_penalty = max(self.repetition_penalty, MIN_REPETITION_PENALTY)
        for name in ("presence_penalty", "frequency_penalty"):
            if abs(getattr(self, name)) < 1e-30:  # below float32's normal range: no penalty
                setattr(self, name, 0.0)
        if self.logit_bias:
            self.logit_bias = {t: (0.0 if abs(v) < 1e-30 else v) for t, v in self.logit_bias.items()}

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
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.seed is not None and not 0 <= self.seed < SEED_RANGE:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        bad = next((t for t in self.stop_token_ids if not 0 <= t <= INT32_MAX), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids must be in [0, {INT32_MAX}], got {bad}")
        self._validate_processing()

    def _validate_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_finite(value) and -2 <= value <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (_finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
            bad_id = next((t for t in self.logit_bias if not 0 <= t <= INT32_MAX), None)
            if bad_id is not None:
                raise ValueError(f"logit_bias token ids must be in [0, {INT32_MAX}], got {bad_id}")
            if not all(_finite(v) for v in self.logit_bias.values()):
                raise ValueError("logit_bias values must be finite numbers")
            self.logit_bias = {int(t): min(100.0, max(-100.0, float(v))) for t, v in self.logit_bias.items()}
        if not 0 <= self.min_tokens <= INT32_MAX:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.bad_words is not None and len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenize `bad_words` as vLLM does: each word alone and after a space (when that is another word)."""
        if not self.bad_words or tokenizer is None:
            return
        ids: list[list[int]] = []
        for word in self.bad_words:
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            ids += [alone] if alone else []
            if spaced and (not alone or (spaced[0] != alone[0] and len(spaced) == len(alone))):
                ids.append(spaced)
        self.bad_words_token_ids = ids

    @property
    def needs_processing(self) -> bool:
        """Whether the sampler must process this request's logits (penalties, bias, bans, a grammar) before drawing."""
        return bool(self.has_penalties or self.logit_bias or self.min_tokens or self.bad_words
                    or self.structured_outputs)

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty needs the request's token history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
