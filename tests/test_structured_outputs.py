"""Structured outputs: a grammar (llguidance) masks each draw in the jitted sampler, so every output parses.

On `tiny` (random weights: it would write anything) through `LLM` and through the server's fields (OpenAI's
`response_format`, vLLM's `structured_outputs` and `guided_*`); on the trained `bard` too when it is present.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from server_helpers import engine_server

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.core.sampling_params import StructuredOutputsParams
from jaxserve.structured import grammar
from jaxserve.structured.limits import DEFAULT_LIMITS, GrammarLimits
from tests.conftest import TINY_ENGINE_ARGS

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "ok", "color", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}}}
PROMPTS = ["Describe a person: ", "JSON please", "x", "Once upon a time"]


def constrained(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def outputs(llm: LLM, spec: StructuredOutputsParams, **kw) -> list:
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=200, structured_outputs=spec, **kw)
              for s in range(len(PROMPTS))]
    return [o.outputs[0] for o in llm.generate(PROMPTS, params)]


def test_every_output_validates_against_its_schema(tiny_llm: LLM) -> None:
    for out in outputs(tiny_llm, constrained(json=SCHEMA)):
        assert out.finish_reason == "stop", out.text  # the grammar ended it (EOS was all it allowed)
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_choice_and_grammar_outputs_match(tiny_llm: LLM) -> None:
    for out in outputs(tiny_llm, constrained(regex=r"[a-z]{3,6}-[0-9]{2}")):
        assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", out.text), out.text
    for out in outputs(tiny_llm, constrained(choice=("yes", "no", "maybe later"))):
        assert out.text in ("yes", "no", "maybe later")
    lark = 'start: "(" expr ")"\nexpr: NUM ("+" NUM){0,3}\nNUM: /[0-9]{1,3}/'
    for out in outputs(tiny_llm, constrained(grammar=lark)):
        assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3}){0,3}\)", out.text), out.text


def test_a_constrained_request_draws_the_same_beside_others(tiny_llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, seed=9, max_tokens=200, structured_outputs=constrained(json=SCHEMA))
    alone = tiny_llm.generate(["abc"], p)[0].outputs[0].text
    free = SamplingParams(temperature=0.7, seed=1, max_tokens=30)
    crowded = tiny_llm.generate(["hello there", "abc", "zz"], [free, p, free])
    assert crowded[1].outputs[0].text == alone
    assert crowded[0].outputs[0].text == tiny_llm.generate(["hello there"], free)[0].outputs[0].text


def test_compiled_grammars_are_cached(tiny_llm: LLM) -> None:
    spec = constrained(regex=r"cache-[0-9]+")
    tiny_llm.generate(["a"], SamplingParams(max_tokens=8, structured_outputs=spec))
    hits = grammar.CACHE.hits
    tiny_llm.generate(["b", "c"], SamplingParams(max_tokens=8, structured_outputs=spec))
    assert grammar.CACHE.hits == hits + 2


def test_a_bad_constraint_is_refused_at_submission(tiny_llm: LLM) -> None:
    with pytest.raises(grammar.GrammarError, match="regex"):
        tiny_llm.generate(["a"], SamplingParams(max_tokens=4, structured_outputs=constrained(regex="(((")))
    with pytest.raises(ValueError, match="exactly one"):
        constrained(regex="a", choice=("b",))


def _tight(spec: StructuredOutputsParams, tokenizer) -> StructuredOutputsParams:
    """`spec` compiled under a lexer-state limit that `[a-z]{60}` passes at first and meets some tokens in."""
    tight = GrammarLimits(max_lexer_states=40)
    matcher = grammar.compile_matcher(grammar.ll_tokenizer(tokenizer, 512), grammar.grammar_source(spec), tight)
    return dataclasses.replace(spec, compiled=grammar.CompiledGrammar(matcher, 0))


def test_a_grammar_that_fails_mid_output_fails_its_request_alone(tiny_llm: LLM) -> None:
    failing = SamplingParams(temperature=1.0, seed=3, max_tokens=70,
                             structured_outputs=_tight(constrained(regex="[a-z]{60}"), tiny_llm.tokenizer))
    fine = SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs=constrained(regex="[0-9]{20}"))
    bad, good = tiny_llm.generate(["a", "b"], [failing, fine])
    assert bad.error.startswith(grammar.GRAMMAR_FAILED) and "too many states" in bad.error
    assert bad.outputs[0].finish_reason == "abort" and len(bad.outputs[0].token_ids) < 60  # failed, not cut
    assert re.fullmatch("[0-9]{20}", good.outputs[0].text) and good.error is None


def test_the_multi_step_loop_takes_constrained_requests_one_step_at_a_time(tiny_llm: LLM) -> None:
    multi = LLM(model="tiny", num_scheduler_steps=4, **{**TINY_ENGINE_ARGS, "max_num_seqs": 4})
    spec = constrained(json=SCHEMA)
    got = [o.text for o in outputs(multi, spec)]
    assert got == [o.text for o in outputs(tiny_llm, spec)]


# ---- the server's fields ----

@pytest.fixture(scope="module")
def server():
    with engine_server(EngineConfig(model="tiny", **TINY_ENGINE_ARGS)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_response_format_json_schema_with_the_official_client(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Who?"}], n=3,
                                       max_tokens=200, temperature=1.0, seed=4, response_format=fmt)
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"


def test_streamed_json_object_parses(client: openai.OpenAI) -> None:
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "{"}], stream=True,
                                            max_tokens=300, temperature=0, response_format={"type": "json_object"},
                                            extra_body={"logit_bias": {"125": 6.0}})  # "}" early: a short object
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"guided_regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}},
     lambda t: 1 <= len(json.loads(t)) <= 3 and all(isinstance(b, bool) for b in json.loads(t))),
    ({"structured_outputs": {"grammar": 'root ::= "a" [0-9] "z"'}}, lambda t: re.fullmatch("a[0-9]z", t)),
])
def test_vllms_fields_on_completions(client: openai.OpenAI, extra: dict, check) -> None:
    r = client.completions.create(model="tiny", prompt="Answer:", max_tokens=60, temperature=1.0, seed=2, n=2,
                                  extra_body=extra)
    for choice in r.choices:
        assert check(choice.text), choice.text


def test_a_grammar_failing_mid_output_is_a_400_not_a_wrong_answer(server) -> None:
    grammars = server.server.config.app.state.generator.grammars
    grammars.limits = GrammarLimits(max_lexer_states=40)  # the worker checked with the defaults: this one fails later
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 70, "temperature": 1.0,
                                                              "seed": 1, "guided_regex": "[a-z]{59}"}, timeout=60)
    finally:
        grammars.limits = DEFAULT_LIMITS
    assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_limit", r.text
    assert "too many states" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "((("}, "guided_regex"),
    ({"guided_json": '{"type": "nope"}'}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
])
def test_bad_constraints_are_400s_naming_their_field(server, extra: dict, param: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- the trained default model (a BPE tokenizer: grammars over multi-byte tokens) ----

def test_the_trained_model_keeps_to_every_constraint() -> None:
    import jaxserve

    if not (Path(jaxserve.__file__).parent / "trained_models" / "bard" / "model.safetensors").is_file():
        pytest.skip("the trained model bard is not in this checkout")
    bard = LLM(model="bard", max_num_seqs=4, max_num_batched_tokens=128, chunk_size=64, page_size=16,
               kv_cache_memory=16 * 2**20, max_model_len=512)
    for out in outputs(bard, constrained(json=SCHEMA)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    for out in outputs(bard, constrained(regex=r"(ROMEO|JULIET): [a-z ]{1,20}\.")):
        assert re.fullmatch(r"(ROMEO|JULIET): [a-z ]{1,20}\.", out.text), out.text
    for out in outputs(bard, constrained(choice=("yes", "no", "my lord"))):
        assert out.text in ("yes", "no", "my lord")
