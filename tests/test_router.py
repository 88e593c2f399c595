"""`jaxserve router` against fake servers (no jax): passthrough with streaming, prefix affinity within load balance,
a dead server retried around, a stream cut by its server ended with an error event, 256 streams at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

import httpx
import pytest
from cli_helpers import run_cli
from disagg_helpers import router_server
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from server_helpers import LiveServer

from jaxserve.router.workers import Policy, Worker, choose, prefix_blocks


def fake_server(name: str, tokens: int = 5, delay: float = 0.0, break_after: int | None = None,
                stall_after: int | None = None, break_first: int = 0) -> FastAPI:
    """A server answering completions with `tokens` events naming itself; `break_after` events it drops the
    connection (as a killed process would); `stall_after` events it hangs, its /health too (as a stopped one);
    its first `break_first` streams it drops before their first event (as a server too busy to answer in time)."""
    app = FastAPI()
    app.state.prompts = []
    app.state.broken = 0
    app.state.stalled = False
    app.state.release = threading.Event()  # ends a stall (so the test's server can stop)

    async def stall() -> None:
        while not app.state.release.is_set():
            await asyncio.sleep(0.05)

    @app.get("/health")
    async def health() -> dict:
        if app.state.stalled:
            await stall()
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.prompts.append((body.get("prompt"), request.headers.get("x-jaxserve-prefill")))
        if not body.get("stream"):
            return {"choices": [{"text": name * tokens, "finish_reason": "length"}]}

        first_broken = app.state.broken < break_first
        app.state.broken += first_broken

        async def events():
            if first_broken:
                raise ConnectionResetError("busy")
            for i in range(tokens):
                if break_after is not None and i == break_after:
                    raise ConnectionResetError("killed")
                if stall_after is not None and i == stall_after:
                    app.state.stalled = True
                    await stall()
                await asyncio.sleep(delay)
                yield f"data: {json.dumps({'choices': [{'text': name, 'finish_reason': None}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def sse(url: str, prompt: str = "p") -> tuple[str, list[str]]:
    """A streamed completion's text and its error events (or the error of a response that is not a stream)."""
    text, errors = "", []
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": prompt, "stream": True}, timeout=30) as r:
        if r.status_code != 200:
            return text, [f"{r.status_code}: {r.read().decode()}"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                text += "".join(c["text"] for c in event.get("choices", []))
                if "error" in event:
                    errors.append(event["error"]["message"])
    return text, errors


def test_a_prompt_returns_to_the_server_that_has_its_prefix_while_loads_are_balanced():
    a, b = Worker("http://a"), Worker("http://b")
    policy = Policy(cache_threshold=0.5, balance_abs_threshold=4)
    long = "shared system prompt " * 40
    first = choose([a, b], prefix_blocks(long + "question one"), policy)
    first.load += 3  # busy, but within the balance threshold
    assert choose([a, b], prefix_blocks(long + "question two"), policy) is first
    other = b if first is a else a
    assert choose([a, b], prefix_blocks("an unrelated prompt " * 40), policy) is other  # new prefixes: the idlest
    first.load += 10  # out of balance: the idlest wins over the cache
    assert choose([a, b], prefix_blocks(long + "question three"), policy) is other
    other.mark_dead()
    assert choose([a, b], prefix_blocks(long), policy) is first
    assert choose([a, b], [], policy, exclude={first.url}) is None


def test_streams_and_whole_responses_pass_through_and_spread_over_replicas():
    apps = [fake_server("a"), fake_server("b")]
    with LiveServer(apps[0]) as a, LiveServer(apps[1]) as b, router_server(worker_urls=(a.url, b.url)) as r:
        texts = {sse(r.url, f"prompt {i} " * 30)[0] for i in range(6)}
        assert texts == {"aaaaa", "bbbbb"}
        whole = httpx.post(f"{r.url}/v1/completions", json={"prompt": "x"}, timeout=30).json()
        assert whole["choices"][0]["text"] in ("aaaaa", "bbbbb")
        assert httpx.get(f"{r.url}/health").status_code == 200
        metrics = httpx.get(f"{r.url}/metrics").text
        assert "jaxserve_router:requests_total 7.0" in metrics


def test_a_dead_server_is_retried_around_and_taken_out_by_its_circuit_breaker():
    dead = "http://127.0.0.1:9"
    with LiveServer(fake_server("a")) as a, router_server(worker_urls=(dead, a.url), health_check_interval=30,
                                                          cb_failure_threshold=2) as r:
        for _ in range(4):  # the prompt's blocks send it back to the dead server while that is in rotation
            assert sse(r.url) == ("aaaaa", [])
        assert httpx.post(f"{r.url}/v1/completions", json={"prompt": "x"}, timeout=30).status_code == 200
        metrics = httpx.get(f"{r.url}/metrics").text
        assert f'worker_healthy{{url="{dead}",role="worker"}} 0.0' in metrics
        assert f'worker_errors_total{{url="{dead}",role="worker"}} 2.0' in metrics
        assert "jaxserve_router:retries_total 2.0" in metrics  # twice: then it was out of rotation


def test_a_server_that_fails_one_request_stays_in_rotation_and_the_request_is_tried_on_it_again():
    app = fake_server("a", break_first=1)
    with LiveServer(app) as a, router_server(worker_urls=(a.url,), health_check_interval=30) as r:
        assert sse(r.url) == ("aaaaa", [])  # its only server, tried again after a pause
        assert sse(r.url) == ("aaaaa", [])
        metrics = httpx.get(f"{r.url}/metrics").text
        assert f'worker_healthy{{url="{a.url}",role="worker"}} 1.0' in metrics
        assert "jaxserve_router:retries_total 1.0" in metrics and app.state.broken == 1
        assert httpx.get(f"{r.url}/health").status_code == 200


def test_without_the_circuit_breaker_failed_requests_leave_a_dead_server_in_rotation():
    dead = "http://127.0.0.1:9"
    with router_server(worker_urls=(dead,), health_check_interval=30, disable_circuit_breaker=True) as r:
        for _ in range(2):
            resp = httpx.post(f"{r.url}/v1/completions", json={"prompt": "x"}, timeout=30)
            assert resp.status_code == 503 and dead in resp.json()["error"]["message"]
        metrics = httpx.get(f"{r.url}/metrics").text
        assert f'worker_healthy{{url="{dead}",role="worker"}} 1.0' in metrics  # the health checks' to judge
        assert f'worker_errors_total{{url="{dead}",role="worker"}} 6.0' in metrics  # 3 tries of each request


def test_no_server_left_is_a_503_in_openais_shape():
    with router_server(worker_urls=("http://127.0.0.1:9",), health_check_interval=30) as r:
        resp = httpx.post(f"{r.url}/v1/completions", json={"prompt": "x", "stream": True}, timeout=30)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_healthy_upstream"
        assert httpx.get(f"{r.url}/health").status_code == 503


def test_a_stream_cut_by_its_server_ends_with_an_error_event():
    with LiveServer(fake_server("a", break_after=2)) as a, router_server(worker_urls=(a.url,),
                                                                        health_check_interval=30) as r:
        text, errors = sse(r.url)
        assert text == "aa" and len(errors) == 1 and a.url in errors[0]


def test_a_stalled_server_is_taken_out_and_its_stream_ended_with_an_error_event():
    app = fake_server("a", stall_after=2)
    with LiveServer(app) as a, router_server(worker_urls=(a.url,), health_check_interval=0.2,
                                             health_check_timeout=1.0, health_failure_threshold=2) as r:
        start = time.monotonic()
        text, errors = sse(r.url)
        assert text == "aa" and len(errors) == 1 and time.monotonic() - start < 10  # not the 60 s stall timeout
        assert httpx.get(f"{r.url}/health").status_code == 503
        app.state.release.set()


def test_pd_mode_sends_requests_to_decode_servers_naming_prefill_servers():
    prefill_app, decode_app = fake_server("p"), fake_server("d")
    with LiveServer(prefill_app) as p, LiveServer(decode_app) as d, router_server(
            pd_disaggregation=True, prefill_urls=(p.url, "http://127.0.0.1:9"), decode_urls=(d.url,),
            health_check_interval=30) as r:
        assert sse(r.url, "hello") == ("ddddd", [])
        prompt, header = decode_app.state.prompts[-1]
        assert prompt == "hello" and header.split(",")[0] in (p.url, "http://127.0.0.1:9")
        assert set(header.split(",")) == {p.url, "http://127.0.0.1:9"}  # every healthy one, as fallbacks


# Exclusive: the clients, the router and its server share one process; with the other worker compiling beside
# them, a connect waited past the router's 5 s timeout once (a suite run, 2026-12-07), which takes a server out.
@pytest.mark.exclusive
@pytest.mark.parametrize("n", [64, pytest.param(256, marks=pytest.mark.slow)])
def test_concurrent_streams_all_complete(n):
    with (LiveServer(fake_server("a", tokens=20, delay=0.05)) as a, router_server(worker_urls=(a.url,)) as r,
          concurrent.futures.ThreadPoolExecutor(n) as pool):
        results = list(pool.map(lambda i: sse(r.url, str(i)), range(n)))
    assert [e for _, e in results if e] == []
    assert [t for t, _ in results] == ["a" * 20] * n


@pytest.mark.parametrize("args, mentions", [
    (["--pd-disaggregation", "--prefill", "http://a:1"], "--decode"),
    ([], "--worker-urls"),
    (["--worker-urls", "localhost:8000"], "not a base URL"),
    (["--worker-urls", "http://a:1", "--prefill", "http://b:1"], "--pd-disaggregation"),
])
def test_bad_router_flags_are_one_line_and_exit_2(args, mentions):
    code, err = run_cli("router", *args)
    assert code == 2 and mentions in err and len(err.strip().splitlines()) == 1
