"""Grammars for structured outputs, with llguidance: a `StructuredOutputsParams` becomes a matcher that, before
each draw, writes the allowed tokens into a row of the sampler's int32 bitmask and is advanced on the host by the
tokens the request drew.

llguidance is a self-contained wheel (Rust, no runtime dependencies), so serving needs no torch; it takes JSON
schemas, regular expressions, choices and Lark or GBNF grammars. Every constraint passes the checks of
structured/limits.py before llguidance sees it, and compiles under llguidance's run-time limits. A compiled
grammar (`CompiledGrammar`: the matcher after its first mask, where llguidance builds its lexer) is shared: a
request gets a copy (`deep_copy`, which shares the lexer state). The server compiles in a worker process first
(structured/compiler.py) and hands the engine the compiled grammar on the request's params; the offline `LLM`
compiles here, through a byte-bounded cache. JSON is compact by default (", " and ": " between items and keys,
no other whitespace) so that a model cannot stall in whitespace; a schema's own `x-guidance` options override
that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from jaxserve.core.sampling_params import StructuredOutputsParams
from jaxserve.core.tokenizer import ByteTokenizer, HFTokenizer
from jaxserve.structured.grammar_cache import GrammarCache, allocated_bytes
from jaxserve.structured.limits import (
    DEFAULT_LIMITS,
    GrammarError,
    GrammarLimitError,
    GrammarLimits,
    check_grammar,
    check_json_schema,
    check_regex,
    check_rule_count,
    check_size,
    llguidance_module,
)

__all__ = ["CompiledGrammar", "Grammar", "GrammarError", "GrammarLimitError", "compile_grammar", "grammar_source",
           "matcher"]
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'
GRAMMAR_FAILED = "The structured output constraint failed during generation"  # RequestOutput.error's start
CACHE = GrammarCache()  # the offline path's (the server's compiler keeps its own)


class _ByteVocab:
    """The byte tokenizer's vocabulary as llguidance reads it: ids 0-255 are bytes, the rest special tokens."""

    def __init__(self, bos: int | None, eos: int | None, vocab_size: int) -> None:
        self.eos_token_id, self.bos_token_id = eos, bos
        names = {bos: b"<|bos|>", eos: b"<|eos|>"}
        self.tokens = [bytes([i]) if i < 256 else b"\xff" + names.get(i, b"<|unused_%d|>" % i)
                       for i in range(vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def tokenizer_spec(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """What llguidance needs of one of our tokenizers, as plain data (a worker process rebuilds it from this)."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "bytes", "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "vocab": vocab_size}
    if isinstance(tokenizer, HFTokenizer):
        return {"kind": "hf", "json": tokenizer.to_json(), "eos": list(tokenizer.eos_token_ids),
                "vocab": vocab_size}
    raise GrammarError("structured outputs need the model's tokenizer")


def ll_tokenizer_from(spec: dict[str, Any]) -> Any:
    """llguidance's LLTokenizer from `tokenizer_spec`'s data."""
    llg = llguidance_module()
    if spec["kind"] == "bytes":
        vocab = _ByteVocab(spec["bos"], spec["eos"], spec["vocab"])
        return llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=spec["vocab"])
    return llg.LLTokenizer(spec["json"], n_vocab=spec["vocab"], eos_token=spec["eos"])


@lru_cache(maxsize=8)
def ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of one of our tokenizers, over the model's whole vocabulary (built once per tokenizer: it
    walks the whole vocabulary)."""
    return ll_tokenizer_from(tokenizer_spec(tokenizer, vocab_size))


def grammar_source(spec: StructuredOutputsParams, limits: GrammarLimits = DEFAULT_LIMITS) -> str:
    """llguidance's grammar for `spec`, once it passes `limits` (compiling checks the rest); raises
    GrammarError."""
    try:
        if spec.json is not None:
            schema = check_json_schema(spec.json, limits)
            text = spec.json if isinstance(spec.json, str) else json.dumps(schema)  # declared order: outputs keep it
            return llguidance_module().LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
        if spec.json_object:
            return llguidance_module().LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_DEFAULTS)
        if spec.regex is not None:
            check_regex(spec.regex, limits)
            return llguidance_module().LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            check_size("".join(spec.choice), limits)
            return llguidance_module().grammar_from("choice", list(spec.choice))  # type: ignore[arg-type]
        check_rule_count(spec.grammar or "", limits)
        try:
            lark = llguidance_module().gbnf_to_lark.any_to_lark(spec.grammar or "")
        except Exception as e:  # the GBNF converter's own errors, RecursionError included
            raise GrammarError(f"the grammar is neither Lark nor GBNF: {type(e).__name__}: {e}") from None
        check_grammar(lark, limits)
        return llguidance_module().LLMatcher.grammar_from_lark(lark)
    except GrammarError as e:
        raise type(e)(_one_line(str(e))) from None
    except ValueError as e:
        raise GrammarError(_one_line(str(e))) from None


def _one_line(message: str) -> str:
    return " ".join(message.split())[:300]


@dataclass
class CompiledGrammar:
    """A grammar ready to copy for requests: its matcher has computed its first mask (so its lexer is built
    and shared by the copies); `nbytes` is what compiling it allocated."""

    matcher: Any  # llguidance's LLMatcher
    nbytes: int


def compile_matcher(tok: Any, source: str, limits: GrammarLimits) -> Any:
    """Compile `source` and compute its first mask; raises GrammarError for a grammar that does not compile or
    that no output satisfies (the first mask allows nothing, not even the end)."""
    m = llguidance_module().LLMatcher(tok, source, log_level=0, limits=limits.parser_limits())
    if m.is_error():
        raise GrammarError(_one_line(m.get_error()))
    m.compute_bitmask()
    if m.is_error():  # llguidance's word for an empty language is NoExtensionBias
        detail = _one_line(m.get_error().replace("<non-verbose/>", ""))[:120]
        raise GrammarError("no output satisfies the constraint" + (f" ({detail})" if detail and "NoExtension"
                                                                    not in detail else ""))
    return m


def compile_grammar(tokenizer: Any, vocab_size: int, source: str,
                    limits: GrammarLimits = DEFAULT_LIMITS) -> CompiledGrammar:
    before = allocated_bytes()
    m = compile_matcher(ll_tokenizer(tokenizer, vocab_size), source, limits)
    return CompiledGrammar(m, max(0, allocated_bytes() - before))


class Grammar:
    """One request's matcher. `fill` first consumes the output tokens it has not seen (so it follows the request
    through any loop), then writes the next allowed tokens into a bitmask row. A matcher that fails (a limit
    reached mid-output) sets `error` and allows only the end tokens from then on; the engine fails the request."""

    def __init__(self, matcher: Any, end_ids: list[int]) -> None:
        self.matcher = matcher
        self.end_ids = end_ids
        self.consumed = 0
        self.error: str | None = None

    def advance(self, output_ids: list[int]) -> None:
        for tid in output_ids[self.consumed:]:
            if self.error is None and not self.matcher.consume_token(int(tid)):
                self.error = _one_line(self.matcher.get_error())[:200] or "a token the grammar refused"
        self.consumed = max(self.consumed, len(output_ids))

    def fill(self, row: np.ndarray, output_ids: list[int]) -> None:
        """Allowed next tokens into `row` ([ceil(V/32)] int32), after `output_ids`."""
        self.advance(output_ids)
        if self.error is None:
            llguidance_module().numpy.fill_next_token_bitmask(self.matcher, row.reshape(1, -1), 0)
            if self.matcher.is_error():
                self.error = _one_line(self.matcher.get_error())[:200]
        if self.error is not None:
            row[:] = 0
            words = row.view(np.uint32)
            for t in self.end_ids:
                if 0 <= t < words.size * 32:
                    words[t >> 5] |= np.uint32(1) << np.uint32(t & 31)

    @property
    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()


def end_ids(tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        ids = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    return [int(t) for t in ids]


def compiled(spec: StructuredOutputsParams, tokenizer: Any, vocab_size: int) -> CompiledGrammar:
    """`spec`'s compiled grammar: the one the server attached, else from the cache or compiled here."""
    if spec.compiled is not None:
        return spec.compiled
    source = grammar_source(spec)
    key = (tokenizer, vocab_size, source)
    hit = CACHE.get(key)
    if hit is None:
        hit = compile_grammar(tokenizer, vocab_size, source)
        CACHE.put(key, hit, hit.nbytes)
    return hit


def matcher(spec: StructuredOutputsParams, tokenizer: Any, vocab_size: int) -> Grammar:
    """A fresh matcher for `spec`; raises GrammarError."""
    return Grammar(compiled(spec, tokenizer, vocab_size).matcher.deep_copy(), end_ids(tokenizer))
