"""Grammars for structured outputs, with llguidance: a `StructuredOutputsParams` becomes a matcher that, before
each draw, writes the allowed tokens into a row of the sampler's int32 bitmask and is advanced on the host by the
tokens the request drew.

llguidance is a self-contained wheel (Rust, no runtime dependencies), so serving needs no torch; it takes JSON
schemas, regular expressions, choices and Lark or GBNF grammars. Compiled grammars are cached per (tokenizer,
grammar): a request gets a copy of the cached matcher (`deep_copy`), so a repeated schema compiles once. JSON is
compact by default (", " and ": " between items and keys, no other whitespace) so that a model cannot stall in
whitespace; a schema's own `x-guidance` options override that.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import llguidance
import numpy as np
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.numpy import fill_next_token_bitmask

from jaxserve.core.sampling_params import StructuredOutputsParams
from jaxserve.core.tokenizer import ByteTokenizer, HFTokenizer

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """A constraint that does not compile; the message says why (in one line)."""


class _ByteVocab:
    """The byte tokenizer's vocabulary as llguidance reads it: ids 0-255 are bytes, the rest special tokens."""

    def __init__(self, tok: ByteTokenizer, vocab_size: int) -> None:
        self.eos_token_id, self.bos_token_id = tok.eos_token_id, tok.bos_token_id
        names = {tok.bos_token_id: b"<|bos|>", tok.eos_token_id: b"<|eos|>"}
        self.tokens = [bytes([i]) if i < 256 else b"\xff" + names.get(i, b"<|unused_%d|>" % i)
                       for i in range(vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@lru_cache(maxsize=8)
def ll_tokenizer(tokenizer: Any, vocab_size: int) -> LLTokenizer:
    """llguidance's view of one of our tokenizers, over the model's whole vocabulary (built once: ~1 s for a
    large BPE vocabulary)."""
    if isinstance(tokenizer, ByteTokenizer):
        return LLTokenizer(TokenizerWrapper(_ByteVocab(tokenizer, vocab_size)), n_vocab=vocab_size)
    if isinstance(tokenizer, HFTokenizer):
        return LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_ids)
    raise GrammarError("structured outputs need the model's tokenizer")


def grammar_source(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for `spec` (not yet checked: `matcher` does that)."""
    try:
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json, sort_keys=True)
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if spec.json_object:
            return LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_DEFAULTS)
        if spec.regex is not None:
            return LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", list(spec.choice))  # type: ignore[arg-type]
        return llguidance.grammar_from("grammar", spec.grammar or "")
    except ValueError as e:
        raise GrammarError(_one_line(str(e))) from None


def _one_line(message: str) -> str:
    return " ".join(message.split())[:300]


@lru_cache(maxsize=256)
def _compiled(tokenizer: Any, vocab_size: int, source: str) -> LLMatcher:
    matcher = LLMatcher(ll_tokenizer(tokenizer, vocab_size), source, log_level=0)
    if matcher.is_error():
        raise GrammarError(_one_line(matcher.get_error()))
    return matcher


class Grammar:
    """One request's matcher. `fill` first consumes the output tokens it has not seen (so it follows the request
    through any loop), then writes the next allowed tokens into a bitmask row."""

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher
        self.consumed = 0

    def advance(self, output_ids: list[int]) -> None:
        for tid in output_ids[self.consumed:]:
            self.matcher.consume_token(int(tid))
        self.consumed = max(self.consumed, len(output_ids))

    def fill(self, row: np.ndarray, output_ids: list[int]) -> None:
        """Allowed next tokens into `row` ([ceil(V/32)] int32), after `output_ids`; a matcher in an error state
        (a token it refused, which the mask should have made impossible) leaves the row as it is."""
        self.advance(output_ids)
        if self.matcher.is_error():
            return
        fill_next_token_bitmask(self.matcher, row.reshape(1, -1), 0)

    @property
    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()


def matcher(spec: StructuredOutputsParams, tokenizer: Any, vocab_size: int) -> Grammar:
    """A fresh matcher for `spec` (compiled once per tokenizer and grammar); raises GrammarError."""
    return Grammar(_compiled(tokenizer, vocab_size, grammar_source(spec)).deep_copy())
