"""Hostile structured outputs and tool calls against a real `jaxserve serve --model tiny` process, watched from
outside: each class of the issue-40 attacks, in generated variants. After every case the process lives, no
answer is a 5xx, /health answered throughout, and the server's resident memory is back within a bound of where
it started. The figures against the targets come from scripts/bench_hostile_grammars.py (docs/server.md).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hostile_grammars import (
    ADD,
    CHAT,
    COMPLETIONS,
    NOTE,
    HealthProbe,
    ServeProcess,
    deep_body,
    malformed_tools,
    past_the_limits,
    repetition_regex,
    wide_schema,
)

MB = 2**20
RSS_BOUND = 300 * MB  # issue 40's target, for the server process alone
HEALTH_BOUND_S = 2.0  # /health answers through every case (liveness, on CI's shared cores)
COMPILING_BOUND_S = 0.5  # while 20 schemas compile (compiles on the event loop held it 1.5 s); the 100 ms target
# is measured by scripts/bench_hostile_grammars.py
FLAGS = ("--max-num-seqs", "16", "--max-num-batched-tokens", "128", "--chunk-size", "64",
         "--kv-cache-memory", "8MiB", "--max-model-len", "1024", "--structured-outputs-cache-bytes", "32MiB")


@pytest.fixture(scope="module")
def server():
    with ServeProcess("tiny", *FLAGS) as live:
        # One grammar first: its worker processes start, and the cache holds one entry from here on.
        assert _post(live, COMPLETIONS, {"prompt": "a", "max_tokens": 2, "guided_regex": "[ab]"}).status_code == 200
        live.start_rss = live.rss()
        yield live
        assert live.alive


@pytest.fixture(autouse=True)
def watched(server: ServeProcess):
    """/health polled through the test; afterwards the process lives and its memory is within the bound."""
    with HealthProbe(server.url) as probe:
        yield
    assert server.alive, server.log_path.read_text()[-3000:]
    assert not probe.failures and probe.worst() < HEALTH_BOUND_S, (probe.failures[:5], probe.worst())
    assert server.rss() - server.start_rss < RSS_BOUND, (server.rss() // MB, server.start_rss // MB)


def _post(server: ServeProcess, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=120)
    else:
        r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code < 500, r.text[:500]
    return r


def _refused(r: httpx.Response, param: str | None = None) -> dict:
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert "\n" not in err["message"] and len(err["message"]) < 600
    assert param is None or err["param"] == param, (param, err)
    return err


@pytest.mark.parametrize("seed", range(3))
def test_constraints_past_the_limits_are_400s_naming_field_and_limit(server: ServeProcess, seed: int) -> None:
    for path, body, param, limit in past_the_limits(random.Random(seed), 12):
        err = _refused(_post(server, path, body), param)
        assert limit in err["message"], err


def test_distinct_pathological_regexes_leave_memory_bounded(server: ServeProcess) -> None:
    rng = random.Random(7)
    regexes = {repetition_regex(rng, over=i % 2 == 1) for i in range(30)}
    accepted = 0
    for rx in sorted(regexes):  # about 4.6 MB each compiled: a 32 MiB cache keeps six, evicting the rest
        r = _post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 6, "guided_regex": rx})
        if r.status_code == 400:
            assert "max_repeat" in r.json()["error"]["message"]
        accepted += r.status_code == 200
    assert accepted >= 10
    assert server.children_rss() < 1024 * MB  # the worker processes are bounded too


@pytest.mark.exclusive
def test_twenty_distinct_schemas_compile_while_health_answers(server: ServeProcess) -> None:
    bodies = [{"prompt": "x", "max_tokens": 4, "guided_json": wide_schema(500 + i)} for i in range(20)]
    with HealthProbe(server.url, interval=0.01) as probe, ThreadPoolExecutor(20) as pool:
        statuses = list(pool.map(lambda b: _post(server, COMPLETIONS, b).status_code, bodies))
    assert statuses == [200] * 20
    assert probe.worst() < COMPILING_BOUND_S and len(probe.latencies) > 5


@pytest.mark.parametrize("seed", range(2))
def test_malformed_tools_choices_and_calls_are_400s_naming_the_field(server: ServeProcess, seed: int) -> None:
    for body, param in malformed_tools(random.Random(seed)):
        _refused(_post(server, CHAT, body), param)


def test_deep_nesting_anywhere_is_refused_before_it_is_walked(server: ServeProcess) -> None:
    rng = random.Random(3)
    for _ in range(12):
        err = _refused(_post(server, CHAT, deep_body(rng)))
        assert err["code"] == "invalid_json" and "limit of 128" in err["message"]


@pytest.mark.parametrize("regex", [r"[^\s\S]", r"ab[^\s\S]", r"(?:[^\s\S])+x", r"[^\s\S]{2}|[^\s\S]"])
def test_a_constraint_no_output_satisfies_is_refused(server: ServeProcess, regex: str) -> None:
    err = _refused(_post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 4, "guided_regex": regex}),
                   "guided_regex")
    assert "no output satisfies" in err["message"]


def _tokens(server: ServeProcess, **kw) -> list[int]:
    body = {"prompt": "Once upon", "max_tokens": 12, "logprobs": 0, "seed": 5, **kw}
    r = _post(server, COMPLETIONS, body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_sampling_values_below_float32_mean_what_they_say(server: ServeProcess) -> None:
    greedy = _tokens(server, temperature=0)
    assert _tokens(server, temperature=1.0, top_p=1e-300) == greedy  # the most likely token alone
    assert _tokens(server, temperature=1e-300) == greedy
    tiny_penalty = _tokens(server, temperature=1.0, repetition_penalty=1e-300)
    assert tiny_penalty == _tokens(server, temperature=1.0, repetition_penalty=1e-6)  # its clamp: same draw
    assert set(tiny_penalty) != {"\x00"}  # not the all-id-0 answer of NaN logits


@pytest.mark.parametrize("extra, calls", [({"tool_choice": "required"}, range(1, 9)),
                                          ({"tool_choice": "required", "parallel_tool_calls": False}, [1]),
                                          ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, [1])])
def test_enforced_tool_calls_end_within_max_tokens(server: ServeProcess, extra: dict, calls) -> None:
    import json

    for seed, max_tokens in ((0, 60), (1, 150), (2, None)):
        body = {"messages": [{"role": "user", "content": "Add 2 and 3."}], "tools": [ADD, NOTE],
                "temperature": 1.0, "seed": seed, **extra, **({"max_tokens": max_tokens} if max_tokens else {})}
        choice = _post(server, CHAT, body).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert len(choice["message"]["tool_calls"]) in calls
        for call in choice["message"]["tool_calls"]:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
