"""Tool calling through the chat endpoint with the official client: `auto` parsed from Hermes-format text (a fake
engine that echoes its prompt writes the call), `required` and a named function enforced by a grammar on `tiny`
(random weights, so only the grammar makes the call parse) and on the trained `bard`, ending within max_tokens
(one call with `parallel_tool_calls: false`), calls streamed as deltas, tool messages and assistant calls
accepted in the history.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
from server_fake_engine import FakeEngine
from server_helpers import LiveServer, engine_server

from jaxserve.config.engine import EngineConfig
from jaxserve.structured.tools import check_tools, parse_tool_calls, streamable_prefix, template_messages
from tests.conftest import TINY_ENGINE_ARGS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'


def test_hermes_calls_are_parsed_out_of_the_text() -> None:
    content, calls = parse_tool_calls(f"Let me look.\n{CALL}\n{CALL.replace('Oslo', 'Rome')}", TOOLS, "auto")
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo", "days": 2}),
                                                                   ("get_weather", {"city": "Rome", "days": 2})]
    assert len({c.id for c in calls}) == 2
    assert parse_tool_calls("<tool_call>not json</tool_call>", TOOLS, "auto")[1] == []
    assert parse_tool_calls(CALL, TOOLS, "none") == (CALL, [])


def test_content_is_streamed_only_up_to_a_possible_call() -> None:
    assert streamable_prefix("Hello <tool_c", TOOLS, "auto") == "Hello "
    assert streamable_prefix("Hello <tool_call>{", TOOLS, "auto") == "Hello "
    assert streamable_prefix("Hello <b>", TOOLS, "auto") == "Hello <b>"
    assert streamable_prefix('[{"name"', TOOLS, "required") == ""


@pytest.mark.parametrize("tools, choice, message", [
    ([{"type": "function"}], "auto", "tools[0]"),
    ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "auto", "tools[0].function.parameters"),
    (None, "required", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
])
def test_bad_tools_are_refused(tools, choice, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        check_tools(tools, choice)


def test_a_template_without_tools_gets_them_as_a_system_message() -> None:
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}]
    msgs = template_messages(history, TOOLS, "{{ messages }}")
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}  # templates expect an object
    assert template_messages(history, TOOLS, "{% for t in tools %}{% endfor %}")[0]["role"] == "assistant"


# ---- auto, against a fake engine that writes back its prompt ----

@pytest.fixture(scope="module")
def fake_client():
    with LiveServer(build_fake_app()) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def build_fake_app():
    from jaxserve.server.app import build_app

    return build_app(FakeEngine(max_model_len=2048))


def _echoed(client: openai.OpenAI, **kw):
    messages = [{"role": "user", "content": f"x{CALL}"}]  # the fake answers "<user>x<tool_call>...</tool_call>\n"
    return client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, stop=["<assistant>"],
                                          temperature=0, max_tokens=400, **kw)


def test_auto_calls_come_back_as_tool_calls(fake_client: openai.OpenAI) -> None:
    r = _echoed(fake_client)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "<user>x"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}


def test_auto_calls_stream_as_deltas(fake_client: openai.OpenAI) -> None:
    chunks = list(_echoed(fake_client, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "<user>x"  # the call's text never shows as content
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_messages_and_calls_in_the_history_are_accepted(fake_client: openai.OpenAI) -> None:
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = fake_client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=5)
    assert r.choices[0].message.content


# ---- required and named, enforced by a grammar on tiny ----

@pytest.fixture(scope="module")
def client():
    # A longer context than the default: the tools' text goes into the prompt.
    with engine_server(EngineConfig(model="tiny", **{**TINY_ENGINE_ARGS, "max_model_len": 2048})) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_required_always_gives_calls_that_validate(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                       tools=TOOLS, tool_choice="required", n=4, temperature=1.0, seed=1,
                                       max_tokens=300)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_always_called(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    for stream in (False, True):
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=TOOLS, tool_choice=choice,
                  temperature=1.0, seed=3, max_tokens=100)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        else:
            calls = client.chat.completions.create(**kw).choices[0].message.tool_calls
        (call,) = calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])


def test_required_calls_end_whatever_the_budget_and_one_when_not_parallel(client: openai.OpenAI) -> None:
    for max_tokens, parallel in ((80, True), (120, False), (None, True)):  # 80: the tightest caps just fit
        kw = {"max_tokens": max_tokens} if max_tokens else {}
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                           tools=TOOLS, tool_choice="required", n=3, temperature=1.0, seed=7,
                                           parallel_tool_calls=parallel, **kw)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
            assert parallel or len(choice.message.tool_calls) == 1
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---- the trained default model ----

@pytest.fixture(scope="module")
def bard_client():
    import jaxserve

    if not (Path(jaxserve.__file__).parent / "trained_models" / "bard" / "model.safetensors").is_file():
        pytest.skip("the trained model bard is not in this checkout")
    config = EngineConfig(model="bard", max_num_seqs=8, max_num_batched_tokens=128, chunk_size=64, page_size=16,
                          kv_cache_memory=32 * 2**20, max_model_len=512, warmup=False)  # shapes compile as they run
    with engine_server(config) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=300)


UNBOUNDED = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
             {"type": "function", "function": {"name": "note", "parameters": {
                 "type": "object", "properties": {"text": {"type": "string"}, "score": {"type": "number"},
                                                  "tags": {"type": "array", "items": {"type": "string"}}}}}}]


@pytest.mark.parametrize("choice, parallel", [("required", None), ("required", False),
                                              ({"type": "function", "function": {"name": "add"}}, None)])
def test_enforced_calls_parse_in_every_run_on_bard(bard_client: openai.OpenAI, choice, parallel) -> None:
    """Unbounded integers, strings and lists in the schemas: the caps make every call end and parse."""
    kw = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = bard_client.chat.completions.create(model="bard", messages=[{"role": "user", "content": "Add 2 and 3."}],
                                            tools=UNBOUNDED, tool_choice=choice, n=8, temperature=1.0, seed=11,
                                            **kw)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        assert parallel is not False or len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            assert isinstance(json.loads(call.function.arguments), dict)


def test_tools_are_described_compactly_for_a_template_without_them() -> None:
    (system,) = [m for m in template_messages([], TOOLS, "{{ messages }}") if m["role"] == "system"]
    lines = system["content"].splitlines()
    assert "<tool_call>" in lines[0]
    assert lines[1:] == ['get_weather(city: string, days: integer): The weather in a city',
                         'get_time(zone: "UTC"|"CET"|"PST")']


def test_a_context_error_says_how_many_tokens_the_tools_took() -> None:
    from jaxserve.core.tokenizer import ByteTokenizer
    from jaxserve.server.app import build_app

    fake = FakeEngine(max_model_len=160)
    fake.tokenizer = ByteTokenizer()  # jaxserve's, whose chat template leaves the tools to a system message
    with LiveServer(build_app(fake)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                           tools=TOOLS, max_tokens=64)
    message = e.value.body["message"]
    took = int(re.search(r"The 2 tools took (\d+) of its tokens", message).group(1))
    # the byte tokenizer: the tools' system message is one token a byte, plus the template's framing of it
    system = template_messages([], TOOLS, "{{ messages }}")[0]["content"]
    assert len(system.encode()) <= took <= len(system.encode()) + 32
