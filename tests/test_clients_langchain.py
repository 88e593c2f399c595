"""langchain-openai's `ChatOpenAI` against the real server (`tiny`): a plain chat, streaming, and every
structured-output method (`json_schema`, `function_calling`, `json_mode`), which langchain turns into
`response_format` or a forced tool call; the grammar makes each answer parse into the schema.
"""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field
from server_helpers import engine_server

from jaxserve.config.engine import EngineConfig
from tests.conftest import TINY_ENGINE_ARGS

langchain_openai = pytest.importorskip("langchain_openai")


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def chat():
    with engine_server(EngineConfig(model="tiny", **TINY_ENGINE_ARGS)) as live:
        yield langchain_openai.ChatOpenAI(base_url=f"{live.url}/v1", api_key="none", model="tiny",
                                          max_tokens=120, temperature=0.8, seed=3, max_retries=0)


def test_plain_and_streamed_chat(chat) -> None:
    reply = chat.invoke("Hello")
    assert isinstance(reply.content, str) and reply.response_metadata["finish_reason"] in ("stop", "length")
    streamed = "".join(chunk.content for chunk in chat.stream("Hello"))
    assert streamed == reply.content  # seeded: the same draw


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_parses_into_the_schema(chat, method: str) -> None:
    person = chat.with_structured_output(Person, method=method, strict=True).invoke("Describe someone.")
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_json_mode_gives_a_json_object(chat) -> None:
    bounded = chat.bind(logit_bias={"125": 6.0})  # "}" early: random weights would write a long object
    out = bounded.with_structured_output(None, method="json_mode").invoke("Reply in JSON.")
    assert isinstance(out, dict)


def test_bound_tools_with_tool_choice_any_are_called(chat) -> None:
    def get_time(zone: Literal["UTC", "CET", "PST"]) -> str:
        """The time in a time zone."""
        return zone

    reply = chat.bind_tools([get_time], tool_choice="any").invoke("What time is it?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_time"
    assert reply.tool_calls[0]["args"]["zone"] in ("UTC", "CET", "PST")
