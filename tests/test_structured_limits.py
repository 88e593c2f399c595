"""The bounds on constraints (structured/limits.py), the byte-bounded grammar cache, the worker-process compiler
(a crash or a timeout costs one compile, never this process), tool-call grammars that always end, and sampling
values that underflow float32. No engine: the tokenizers of `tiny` (bytes) and `bard` (BPE) only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random

import numpy as np
import pytest
from hostile_grammars import gbnf_chain, json_in_lark, lark_chain, nested_schema, ref_chain
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher

from jaxserve.core.json_depth import json_depth
from jaxserve.core.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.core.tokenizer import load_tokenizer
from jaxserve.structured import grammar
from jaxserve.structured.compile_worker import CompileWorker, WorkerUnavailable
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.grammar_cache import GrammarCache
from jaxserve.structured.limits import GrammarError, GrammarLimitError, GrammarLimits, schema_depth
from jaxserve.structured.tool_grammar import (
    CAPS_LADDER,
    ESCAPES,
    arguments_schema,
    call_list_schema,
    cap_schema,
    worst_case_bytes,
)

TINY = load_tokenizer("tiny")
Spec = StructuredOutputsParams


# ---- nesting, measured without recursion ----

_SCALARS = st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from('ab[]{}"\\:,é'))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                                           max_size=3), max_leaves=60)


def _true_depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_true_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_true_depth, value.values()), default=0)
    return 0


@settings(max_examples=200, deadline=None)
@given(_JSON, st.booleans())
def test_json_depth_is_the_depth_json_would_recurse_to(value, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert json_depth(text) == json_depth(text.encode()) == _true_depth(value)


def test_a_schema_is_measured_through_its_refs_and_a_recursive_one_is_finite() -> None:
    assert schema_depth(ref_chain(500)) == 503
    tree = {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array",
                                                                          "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    assert schema_depth(tree) < 10


# ---- every class past a limit is refused before llguidance, naming the limit ----

@pytest.mark.parametrize("seed", range(6))
def test_constraints_past_a_limit_are_refused_naming_it(seed: int) -> None:
    rng = random.Random(seed)
    cases = [(Spec(json=ref_chain(rng.randrange(65, 5000))), "max_depth"),
             (Spec(json=json.dumps(nested_schema(rng.randrange(65, 400), rng))), "max_depth"),
             (Spec(grammar=lark_chain(rng.randrange(260, 1990))), "max_depth"),
             (Spec(grammar=gbnf_chain(rng.randrange(2001, 6000))), "max_rules"),
             (Spec(grammar=json_in_lark(ref_chain(rng.randrange(65, 3000)))), "max_depth"),
             (Spec(regex=f"(x{{{rng.randrange(101, 999)}}}){{{rng.randrange(101, 999)}}}"), "max_repeat"),
             (Spec(regex="(" * rng.randrange(65, 240) + "a" + ")" * 240), "max_depth"),
             (Spec(json={"type": "string", "pattern": f"a{{{rng.randrange(10_001, 10**7)}}}"}), "max_repeat"),
             (Spec(regex="a" * (128 * 2**10 + rng.randrange(1, 999))), "max_source_bytes")]
    for spec, limit in cases:
        with pytest.raises(GrammarLimitError, match=limit):
            grammar.grammar_source(spec)


def test_constraints_within_the_limits_compile() -> None:
    for spec in [Spec(json=ref_chain(60)), Spec(grammar=lark_chain(200)), Spec(regex="(a{100}){100}"),
                 Spec(grammar='root ::= "a" [0-9]{1,3} "z"'), Spec(choice=("yes", "no"))]:
        assert grammar.compile_grammar(TINY, 512, grammar.grammar_source(spec)).nbytes >= 0


@pytest.mark.parametrize("spec", [Spec(regex=r"[^\s\S]"), Spec(regex=r"ab[^\s\S]c"), Spec(regex=r"(?:[^\s\S])+"),
                                  Spec(grammar="start: A\nA: /[^\\s\\S]/"),
                                  Spec(json={"type": "string", "minLength": 3, "maxLength": 2})])
def test_a_constraint_no_output_satisfies_is_refused(spec: Spec) -> None:
    with pytest.raises(GrammarError):
        grammar.compile_grammar(TINY, 512, grammar.grammar_source(spec))


# ---- the cache, by bytes ----

def test_the_cache_keeps_what_fits_its_bytes_and_evicts_the_oldest() -> None:
    cache = GrammarCache(capacity=100)
    for i in range(5):
        cache.put(i, f"g{i}", 30)
    assert len(cache) == 3 and cache.bytes == 90 and cache.get(0) is None and cache.get(4) == "g4"
    cache.get(2)  # now the most recently used
    cache.put("big", "g", 60)
    assert cache.get(2) == "g2" and cache.get(3) is None and cache.bytes == 90
    cache.put("huge", "g", 101)  # larger than the whole cache: not kept, nothing evicted
    assert cache.get("huge") is None and cache.bytes == 90


def test_a_compiled_grammar_is_charged_what_it_allocated() -> None:
    small = grammar.compile_grammar(TINY, 512, grammar.grammar_source(Spec(regex="[a-z]{3}")))
    heavy = grammar.compile_grammar(TINY, 512, grammar.grammar_source(Spec(regex="(b{100}){100}")))
    assert small.nbytes < 2**20 < heavy.nbytes


# ---- the worker processes ----

def _compile_all(compiler: GrammarCompiler, specs: list[Spec]) -> list:
    async def run() -> list:
        out = []
        for spec in specs:
            try:
                out.append(await compiler.compile(spec))
            except GrammarError as e:
                out.append(e)
        compiler.close()
        return out

    return asyncio.run(run())


def test_a_grammar_that_crashes_llguidance_costs_one_compile_not_the_process() -> None:
    # Limits loosened and the child's stack cut to 4 MB so that a 3,000-rule chain overflows it: in this
    # process's own thread it would segfault pytest.
    loose = GrammarLimits(max_depth=10**6, max_rules=10**6)
    compiler = GrammarCompiler(TINY, 512, limits=loose, worker_stack_bytes=4 * 2**20, num_workers=1)
    crash, after = _compile_all(compiler, [Spec(grammar=lark_chain(3000)), Spec(regex="[a-z]{2}")])
    assert isinstance(crash, GrammarError) and "crashed" in str(crash)
    assert isinstance(after, grammar.CompiledGrammar)  # a fresh child took over
    assert compiler.crashes == 2 and compiler.workers[0].starts == 3  # one retry, then a child for the next


def test_a_compile_past_its_time_budget_is_killed_and_refused() -> None:
    slow = GrammarLimits(max_repeat=10**7, initial_lexer_fuel=10**7)  # (b{1000}){1000} takes about a second
    compiler = GrammarCompiler(TINY, 512, limits=slow, timeout_s=0.2, num_workers=1)
    late, after = _compile_all(compiler, [Spec(regex="(b{1000}){1000}"), Spec(regex="[a-z]{2}")])
    assert isinstance(late, GrammarLimitError) and "0.2 s" in str(late)
    assert isinstance(after, grammar.CompiledGrammar) and compiler.timeouts == 1


def test_a_compiler_process_that_cannot_start_is_the_servers_fault_not_the_requests() -> None:
    broken = CompileWorker({"kind": "hf", "json": "not a tokenizer", "eos": [0], "vocab": 8},
                           dataclasses.asdict(GrammarLimits()))

    async def run() -> None:
        with pytest.raises(WorkerUnavailable, match="did not start"):
            await broken.check("{}", 5)

    asyncio.run(run())
    assert broken.proc is None


def test_concurrent_requests_for_one_grammar_share_its_compile() -> None:
    compiler = GrammarCompiler(TINY, 512, num_workers=1)

    async def run() -> list:
        out = await asyncio.gather(*[compiler.compile(Spec(regex="[0-9]{4}")) for _ in range(8)])
        compiler.close()
        return out

    compiled = asyncio.run(run())
    assert all(c is compiled[0] for c in compiled) and compiler.cache.misses == 8 and len(compiler.cache) == 1


# ---- tool calls that end ----

def _longest_walk(src: str, seed: int) -> bytes:
    """A walk through the grammar that puts off closing whatever it can (a string, an object, a list), and takes
    multi-byte characters and escapes: the long outputs a model could write."""
    m = LLMatcher(grammar.ll_tokenizer(TINY, 512), src, log_level=0)
    rng, out, in_string, escaped = random.Random(seed), bytearray(), False, False
    while True:
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
        allowed = [int(t) for t in np.flatnonzero(bits) if t < 256]
        if not allowed:
            return bytes(out)
        closing = set(b'"') if in_string else set(b"}]")
        keep = [t for t in allowed if t not in closing] or allowed
        wide = [t for t in keep if t >= 0xC0 or t == ord("\\")]
        tok = rng.choice(wide if wide and rng.random() < 0.5 else keep if rng.random() < 0.97 else allowed)
        assert m.consume_token(tok)
        out.append(tok)
        if in_string and not escaped and tok == ord('"') or not in_string and tok == ord('"'):
            in_string = not in_string
        escaped = in_string and not escaped and tok == ord("\\")


PARAMS = [{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "t": {"type": "number"}, "ok": {"type": "boolean"},
                                            "tags": {"type": "array", "items": {"type": "string"}},
                                            "kind": {"enum": ["a", "bb"]}, "n": {"type": ["integer", "null"]}}},
          {"type": "object", "properties": {"s": {"type": "string", "pattern": "[a-z]+"},
                                            "x": {"anyOf": [{"type": "string"},
                                                            {"type": "object", "properties": {
                                                                "y": {"type": "number", "multipleOf": 0.25}}}]},
                                            "p": {"$ref": "#/$defs/p"}},
           "$defs": {"p": {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "boolean"}}}}]


@pytest.mark.parametrize("params", PARAMS)
def test_capped_arguments_never_outgrow_their_bound(params: dict) -> None:
    for caps in CAPS_LADDER[::2]:
        capped = cap_schema(params, caps)
        bound = worst_case_bytes(capped)
        src = LLMatcher.grammar_from_json_schema(json.dumps(capped), defaults={**grammar.JSON_DEFAULTS, **ESCAPES})
        for seed in range(6):
            text = _longest_walk(src, seed)
            json.loads(text)
            assert len(text) <= bound, (caps, text)


@pytest.mark.parametrize("budget", [40, 120, 300, 2000])
def test_the_call_list_fits_the_budget(budget: int) -> None:
    tools = {"add": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
             "note": PARAMS[0]}
    for parallel in (True, False):
        schema, k = call_list_schema(tools, budget, parallel)
        assert schema["maxItems"] == k and (k == 1 or parallel)
        src = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=grammar.JSON_DEFAULTS)
        for seed in range(4):
            calls = json.loads(_longest_walk(src, seed))
            assert 1 <= len(calls) <= k
            if budget >= 120:  # the tightest caps fit from here on: the whole list, and the end, fit
                assert len(json.dumps(calls, separators=(", ", ": ")).encode()) + 1 <= budget
    named = arguments_schema(PARAMS[0], 200)
    assert worst_case_bytes(named) + 1 <= 200


def test_an_open_schema_stays_unbounded_and_gets_one_call() -> None:
    schema, k = call_list_schema({"any": {"type": "object", "additionalProperties": True}}, 4000, True)
    assert k == 1 and worst_case_bytes(schema["items"]["anyOf"][0]) == float("inf")


# ---- sampling values float32 cannot carry ----

def test_underflowing_sampling_values_are_clamped_to_their_meaning() -> None:
    p = SamplingParams(temperature=1.0, top_p=1e-300, repetition_penalty=1e-300, min_p=1e-300,
                       presence_penalty=1e-300, logit_bias={3: 1e-300})
    f32 = np.float32
    assert f32(p.top_p) > 0 and f32(p.repetition_penalty) > 0 and np.isfinite(f32(10.0) / f32(p.repetition_penalty))
    assert p.min_p == 0 and p.presence_penalty == 0 and p.logit_bias == {3: 0.0}
    assert SamplingParams(temperature=1e-300).greedy and not SamplingParams(temperature=0.5).greedy
    assert SamplingParams(top_p=0.3).top_p == 0.3 and SamplingParams(repetition_penalty=1.2).repetition_penalty == 1.2
