"""Lenient on what clients add, strict on what matters: the fields SDKs send routinely are accepted (unknown ones
logged by name, as vLLM does), whole-number floats pass for integer fields, vLLM's
`stream_options.continuous_usage_stats` puts the usage in every chunk; wrong types and values still 400.
Fake engine, so it stays fast.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from server_fake_engine import FakeEngine
from server_helpers import LiveServer, ServerLog

from jaxserve.server.app import build_app
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest, ignored_fields


@pytest.fixture(scope="module")
def url():
    with LiveServer(build_app(FakeEngine(max_model_len=1024))) as server:
        yield server.url


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=30)


def _warnings(log: ServerLog) -> list[str]:
    return [r.getMessage() for r in log.records if r.levelno == logging.WARNING and r.name == "jaxserve.server"]


def test_what_sdks_send_is_accepted_and_the_unknown_fields_named_in_one_warning(url: str) -> None:
    body = {"messages": [{"role": "system", "content": "be brief", "name": "setup"},
                         {"role": "user", "content": "hi", "name": "ada"},
                         {"role": "assistant", "content": None,
                          "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "f", "arguments": "{}"}}]},
                         {"role": "tool", "content": "42", "tool_call_id": "c1"},
                         {"role": "user", "content": "and?", "audio": None}],
            "max_tokens": 3, "parallel_tool_calls": False, "store": False, "metadata": {"k": "v"},
            "service_tier": "auto"}
    with ServerLog() as log:
        r = _post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    (line,) = [w for w in _warnings(log) if "ignored" in w]
    for name in ("store", "metadata", "service_tier", "messages[4].audio"):
        assert name in line
    for known in ("max_tokens", "tool_call_id", "parallel_tool_calls"):  # known fields are not reported
        assert known not in line


def test_known_requests_log_no_warning(url: str) -> None:
    with ServerLog() as log:
        assert _post(url, "/v1/completions", {"prompt": "ab", "max_tokens": 2}).status_code == 200
    assert not [w for w in _warnings(log) if "ignored" in w]


def test_whole_number_floats_are_integers() -> None:
    req = CompletionRequest.model_validate({"prompt": "ab", "max_tokens": 5.0, "n": 2.0, "seed": 7.0,
                                            "logprobs": 1.0, "stop_token_ids": [3.0], "top_k": -1.0})
    assert (req.max_tokens, req.n, req.seed, req.logprobs, req.stop_token_ids, req.top_k) == (5, 2, 7, 1, [3], -1)
    assert all(type(v) is int for v in (req.max_tokens, req.n, req.seed, req.logprobs, req.top_k))
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "max_completion_tokens": 4.0, "top_logprobs": 2.0,
                                                 "logprobs": True})
    assert chat.max_tokens == 4 and chat.top_logprobs == 2


def test_ignored_fields_are_named_with_their_path_and_capped() -> None:
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}],
        "stream": True, "stream_options": {"include_usage": True, "extra": 1}, "store": True})
    assert sorted(ignored_fields(req)) == ["messages[0].content[0].cache_control", "store", "stream_options.extra"]
    many = CompletionRequest.model_validate({"prompt": "ab", **{f"f{i}": i for i in range(50)}})
    assert ignored_fields(many) == [f"f{i}" for i in range(8)]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "ab", "max_tokens": 5.5}, "max_tokens"),  # a fraction is not an integer
    ({"prompt": "ab", "max_tokens": "5"}, "max_tokens"),  # nor is a string
    ({"prompt": "ab", "n": True}, "n"),  # nor a bool
    ({"prompt": "ab", "seed": 1e300}, "seed"),  # whole, but out of range
    ({"prompt": "ab", "max_tokens": 0.0}, "max_tokens"),  # whole, but below 1
    ({"prompt": "ab", "frequency_penalty": 3.0}, "frequency_penalty"),  # outside [-2, 2]
    ({"prompt": "ab", "store": True, "temperature": -1}, "temperature"),  # an unknown field hides no error
    ({"messages": [{"role": "narrator", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True,
      "stream_options": {"continuous_usage_stats": "yes"}}, "stream_options.continuous_usage_stats"),
])
def test_values_outside_a_fields_meaning_are_still_400(url: str, body: dict, param: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = _post(url, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def _chunks(r: httpx.Response) -> list[dict]:
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "abcd"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abcd"}]}),
])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(url: str, path: str, body: dict) -> None:
    r = _post(url, path, {**body, "max_tokens": 4, "stream": True,
                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert r.status_code == 200, r.text
    chunks = _chunks(r)
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 4  # grows with the stream, ends complete
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert chunks[-1]["choices"] == []  # the final usage chunk, as without continuous stats


def test_without_continuous_stats_only_the_last_chunk_has_usage(url: str) -> None:
    r = _post(url, "/v1/completions", {"prompt": "abcd", "max_tokens": 3, "stream": True,
                                       "stream_options": {"include_usage": True}})
    usages = [c["usage"] for c in _chunks(r)]
    assert all(u is None for u in usages[:-1]) and usages[-1]["completion_tokens"] == 3
