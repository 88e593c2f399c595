"""Hostile and careless clients (fake engine): readers that stop, half-sent requests, a flood, requests past the
waiting bound or the timeout, and requests cut by shutdown. The server stays healthy through all of it and
logs no error for what clients do.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_fake_engine import FakeEngine
from server_helpers import LiveServer, ServerLog, free_port, wait_until

from jaxserve.config.engine import EngineConfig
from jaxserve.server.app import build_app
from jaxserve.server.limits import ServerLimits

FLOOD = Path(__file__).with_name("server_flood.py")
SERVE = Path(__file__).with_name("server_fake_serve.py")


def _serve(fake: FakeEngine, **limits) -> LiveServer:
    lim = ServerLimits(**limits)
    return LiveServer(build_app(fake, limits=lim), lim)


def _request(path: str, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (path.encode(), len(raw))) + raw


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    out = b""
    while chunk := sock.recv(1 << 16):
        out += chunk
    return out


def test_a_reader_that_stops_is_aborted_and_its_connection_closed() -> None:
    fake = FakeEngine(max_model_len=10**6, step_s=0.0005)
    with _serve(fake, stream_buffer_tokens=64) as server, ServerLog() as log:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        # Eight choices with logprobs fill the kernel's socket buffers in well under a second.
        sock.sendall(_request("/v1/completions", {"prompt": "never read", "max_tokens": 500_000, "stream": True,
                                                  "n": 8, "logprobs": 2}))
        assert wait_until(lambda: len(fake.aborted) == 8 and not fake.running, timeout=20)
        assert fake.counters["generation_tokens"] < 100_000  # stopped long before max_tokens
        out = _read_all(sock, 10)  # what the kernel buffered, then the server's close
        assert out.startswith(b"HTTP/1.1 200") and b"[DONE]" not in out
        sock.close()
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
    assert log.problems() == []
    assert any("stopped reading" in r.getMessage() for r in log.records)


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Ty",
                                  _request("/v1/completions", {"prompt": "half a body"})[:-8]])
def test_half_sent_requests_get_408_and_are_closed(sent: bytes) -> None:
    fake = FakeEngine()
    with _serve(fake, request_read_timeout=0.5) as server, ServerLog() as log:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            t0 = time.monotonic()
            sock.sendall(sent)
            out = _read_all(sock, 5)
            assert 0.4 < time.monotonic() - t0 < 3
        assert out.startswith(b"HTTP/1.1 408") and b"request_timeout" in out
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert not fake.running
    assert log.problems() == []


def test_a_keep_alive_connection_gets_a_fresh_deadline_per_request() -> None:
    with _serve(FakeEngine(), request_read_timeout=0.6) as server, \
            socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(5)
        for _ in range(3):  # each whole request within its deadline, 1.2 s in all
            time.sleep(0.4)
            sock.sendall(_request("/v1/completions", {"prompt": "ab", "max_tokens": 1}))
            assert sock.recv(1 << 16).startswith(b"HTTP/1.1 200")
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # then half of one
        assert _read_all(sock, 5).startswith(b"HTTP/1.1 408")


def test_requests_past_the_waiting_bound_get_429_with_retry_after() -> None:
    fake = FakeEngine(max_model_len=10**5, step_s=0.01)
    fake.config = EngineConfig(model="tiny", warmup=False, max_num_seqs=4)
    with _serve(fake, max_num_waiting=2) as server:
        body = {"prompt": "hold", "max_tokens": 5000, "n": 6, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as held:
            lines = held.iter_lines()  # held: a dropped iterator would close the connection
            next(lines)
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert httpx.get(f"{server.url}/health").status_code == 200
        assert wait_until(lambda: not fake.running, timeout=5)
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 2, "n": 10})
        assert r.status_code == 200  # an idle server admits one request, however large


def test_the_request_timeout_is_504_and_aborts() -> None:
    fake = FakeEngine(max_model_len=10**5, step_s=0.01)
    with _serve(fake, request_timeout=0.3) as server:
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "slow", "max_tokens": 5000})
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert time.monotonic() - t0 < 2
        with httpx.stream("POST", f"{server.url}/v1/completions",
                          json={"prompt": "slow", "max_tokens": 5000, "stream": True}) as s:
            events = [line for line in s.iter_lines() if line]
        assert json.loads(events[-2][6:])["error"]["code"] == "timeout" and events[-1] == "data: [DONE]"
        assert wait_until(lambda: not fake.running, timeout=2) and len(fake.aborted) == 2


def test_requests_cut_by_shutdown_are_503_not_success() -> None:
    fake = FakeEngine(max_model_len=10**5, step_s=0.01)
    with _serve(fake) as server:
        results: dict[str, object] = {}

        def whole() -> None:
            results["whole"] = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 5000})

        def streamed() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions",
                              json={"prompt": "b", "max_tokens": 5000, "stream": True}) as s:
                results["stream"] = [line for line in s.iter_lines() if line]

        threads = [threading.Thread(target=f) for f in (whole, streamed)]
        for t in threads:
            t.start()
        assert wait_until(lambda: len(fake.running) == 2, timeout=5)
        server.server.config.app.state.generator.abort_all()  # what SIGTERM does first
        for t in threads:
            t.join(5)
        r = results["whole"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown"
        events = results["stream"]
        assert json.loads(events[-2][6:])["error"]["code"] == "server_shutdown" and events[-1] == "data: [DONE]"
        late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "c", "max_tokens": 2})
        assert late.status_code == 503


@pytest.mark.exclusive
def test_a_flood_never_stalls_health() -> None:
    """The server in its own process (so the poller's time is not its GIL's), flooded from another for 6 s."""
    port = free_port()
    limits = {"max_num_waiting": 64, "max_prompts_per_request": 64}
    server = subprocess.Popen([sys.executable, str(SERVE), str(port), json.dumps(limits)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        flood = subprocess.Popen([sys.executable, str(FLOOD), str(port), "6", "600", "24"], stdout=subprocess.PIPE,
                                 text=True)
        latencies = []
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            while flood.poll() is None:
                t0 = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.01)
            counts = json.loads(flood.communicate(timeout=30)[0])
            assert client.get("/health").status_code == 200
    finally:
        _, err = server.communicate("", timeout=10)  # stdin closed: the server stops
    # A blocked event loop (a big body parsed or tokenized on it) delays every probe behind it; one slow probe
    # among hundreds is the OS scheduling three busy processes on two cores (CI saw one at 102 ms of 225).
    slow = [t for t in latencies if t >= 0.1]
    assert len(latencies) > 50 and len(slow) <= len(latencies) // 100 + 1 and max(latencies) < 0.5, (
        sorted(latencies)[-5:], len(latencies), counts)
    assert {"200", "400", "413", "415"} <= set(counts) and "500" not in counts and "error" not in counts, counts
    assert "Traceback" not in err and "ERROR" not in err, err[-3000:]
