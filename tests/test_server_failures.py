"""Server behaviour under injected failures, against a fake engine (the real one is hard to break on cue)."""

from __future__ import annotations

import json

import httpx
import pytest
from server_fake_engine import FakeEngine
from server_helpers import LiveServer, wait_until

from jaxserve.server.app import build_app
from jaxserve.server.serving import Generator


@pytest.fixture(scope="module")
def fake() -> FakeEngine:
    return FakeEngine(max_model_len=4096, step_s=0.01)


@pytest.fixture(scope="module")
def url(fake: FakeEngine):
    with LiveServer(build_app(fake)) as server:
        yield server.url


def _ok(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_engine_failure_of_one_request_is_500_and_server_keeps_serving(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "FAIL", "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    _ok(url)


def test_internal_exception_is_500_and_server_keeps_serving(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("formatting bug")

    monkeypatch.setattr(Generator, "completion_response", boom)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 2})
    assert r.status_code == 500
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    monkeypatch.undo()
    _ok(url)


def test_stream_failure_ends_with_error_event_and_done(url: str) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "FAIL", "max_tokens": 2, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] is None
    assert events[-1] == "data: [DONE]"


def test_non_streaming_client_disconnect_aborts(url: str, fake: FakeEngine) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 1000}, timeout=0.3)
    assert wait_until(lambda: not fake.running, timeout=2.0)
    assert any(rid.startswith("cmpl-") for rid in fake.aborted)


def test_streaming_client_disconnect_aborts(url: str, fake: FakeEngine) -> None:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "stream": True}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith('data: {"id"') or not fake.running:
            pass
        assert fake.running
    assert wait_until(lambda: not fake.running, timeout=2.0)


def test_dead_engine_is_503(url: str, fake: FakeEngine) -> None:
    fake.healthy = False
    try:
        assert httpx.get(f"{url}/health").status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["message"]
    finally:
        fake.healthy = True
    assert httpx.get(f"{url}/health").status_code == 200


def test_real_engine_loop_death_is_503_not_a_hang() -> None:
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model="tiny", warmup=False, max_num_seqs=4, max_num_batched_tokens=64,
                                      chunk_size=64, kv_cache_memory=2**20, max_model_len=256))

    def broken_step():
        raise RuntimeError("injected step failure")

    engine.engine.step = broken_step
    engine.start()
    try:
        with LiveServer(build_app(engine)) as server:
            assert httpx.get(f"{server.url}/health").status_code == 200
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 2}, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
            assert httpx.get(f"{server.url}/health").status_code == 503
            r = httpx.post(f"{server.url}/v1/chat/completions", timeout=10,
                           json={"messages": [{"role": "user", "content": "x"}], "stream": True})
            assert r.status_code == 503
    finally:
        engine.shutdown()
