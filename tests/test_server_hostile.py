"""Hostile inputs against the server (fake engine, so they stay fast): keys, content types, sizes, malformed and
oversized bodies, out-of-range and non-finite values. Every answer is one short OpenAI-style error with the right
4xx status, and the server keeps serving. Hostile clients (slow, silent, flooding) are in
test_server_hostile_clients.py.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_fake_engine import FakeEngine
from server_helpers import LiveServer, ServerLog

from jaxserve.cli.serve import serve
from jaxserve.server import yielding_json
from jaxserve.server.app import build_app
from jaxserve.server.limits import ServerLimits

KEYS = ("k-first", "k-second")
LIMIT = 256 * 2**10
MAX_ERROR_BYTES = 2000


@pytest.fixture(scope="module")
def url():
    limits = ServerLimits(max_request_body_bytes=LIMIT, max_prompts_per_request=64)
    with LiveServer(build_app(FakeEngine(max_model_len=4096), limits=limits), limits) as server:
        yield server.url


@pytest.fixture(scope="module")
def keyed():
    limits = ServerLimits(api_keys=KEYS)
    with LiveServer(build_app(FakeEngine(), limits=limits), limits) as server:
        yield server.url


@pytest.fixture(scope="module")
def roomy():
    """A server whose body limit lets 10 MB fields through, to check what its errors echo."""
    limits = ServerLimits(max_request_body_bytes=32 * 2**20)
    with LiveServer(build_app(FakeEngine(), limits=limits), limits) as server:
        yield server.url


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    assert len(r.content) < MAX_ERROR_BYTES, len(r.content)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and "\n" not in err["message"]
    return err


def _still_serving(url: str, headers: dict | None = None) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 2}, headers=headers)
    assert r.status_code == 200, r.text


def _raw(port: int, head: bytes, body: bytes = b"", timeout: float = 5.0) -> bytes:
    """Send `head` and `body` on a fresh connection; everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + body)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


# ---- API keys ----

@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/version"), ("GET", "/docs"), ("GET", "/openapi.json"),
    ("GET", "/redoc"), ("GET", "/no/such/route"),
])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Bearer k-firs", "Bearer k-first-and-more", "Basic k-first",
                                  "k-first", "Bearer"])
def test_every_route_but_health_needs_a_key(keyed: str, method: str, path: str, auth: str | None) -> None:
    headers = {"Authorization": auth} if auth is not None else {}
    r = httpx.request(method, f"{keyed}{path}", headers=headers, json={"prompt": "ab"})
    err = _error(r, 401)
    assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"


def test_valid_keys_open_every_route_and_health_needs_none(keyed: str) -> None:
    assert httpx.get(f"{keyed}/health").status_code == 200
    for key in KEYS:
        headers = {"Authorization": f"bearer {key}"}
        assert httpx.get(f"{keyed}/metrics", headers=headers).status_code == 200
        assert httpx.get(f"{keyed}/docs", headers=headers).status_code == 200
        _still_serving(keyed, headers)
    good = openai.OpenAI(base_url=f"{keyed}/v1", api_key=KEYS[1], max_retries=0)
    assert good.completions.create(model="tiny", prompt="ab", max_tokens=2).choices[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed}/v1", api_key="nope", max_retries=0).models.list()


def test_keys_come_from_flags_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert serve.make_context("serve", ["--api-key", "a", "--api-key", "b"]).params["api_keys"] == ("a", "b")
    monkeypatch.setenv("JAXSERVE_API_KEY", "from-env other")
    assert serve.make_context("serve", []).params["api_keys"] == ("from-env", "other")
    assert serve.make_context("serve", ["--api-key", "flag"]).params["api_keys"] == ("flag",)
    monkeypatch.delenv("JAXSERVE_API_KEY")
    assert serve.make_context("serve", []).params["api_keys"] == ()
    with pytest.raises(ValueError, match="empty"):
        ServerLimits(api_keys=("",))


# ---- content types and sizes ----

@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                   "application/jsonp", "x" * 5000])
def test_only_json_bodies_are_parsed(url: str, ctype: str | None) -> None:
    headers = {"content-type": ctype} if ctype is not None else {}
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "ab", "max_tokens": 2}', headers=headers)
    assert _error(r, 415)["code"] == "unsupported_media_type"
    ok = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "ab", "max_tokens": 2}',
                    headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200


def test_a_declared_oversize_body_is_refused_before_it_is_sent(url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    t0 = time.monotonic()
    out = _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000\r\n\r\n", b'{"prompt": "')
    assert out.startswith(b"HTTP/1.1 413") and time.monotonic() - t0 < 2
    assert b"request_too_large" in out and len(out) < MAX_ERROR_BYTES
    _still_serving(url)


def test_a_chunked_upload_is_cut_at_the_limit(url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 16384
        sent, out = 0, b""
        with pytest.raises(OSError):  # the server answers and closes while we are still sending
            while sent < 100 * LIMIT:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        while True:
            try:
                part = sock.recv(65536)
            except OSError:
                break
            if not part:
                break
            out += part
    assert sent < 20 * LIMIT  # refused at the limit, not after the whole upload
    assert not out or out.startswith(b"HTTP/1.1 413")
    _still_serving(url)


def test_ten_megabyte_fields_come_back_as_short_errors(roomy: str) -> None:
    big = "m" * (10 * 2**20)
    cases = [({"prompt": "ab", "model": big}, 404), ({"prompt": "ab", big: 1, "n": "x"}, 400),
             ({"prompt": "ab", "logit_bias": {str(i): 1.0 for i in range(100_000)}}, 400),
             ({"prompt": "ab", "stop": big}, 400), ({"prompt": "ab", "user": 5, "suffix": big}, 400),
             ({"prompt": big}, 400), ({"prompt": "ab", "temperature": big}, 400),
             ({"messages": [{"role": big, "content": "x"}]}, 400)]
    for body, status in cases:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        _error(httpx.post(f"{roomy}{path}", json=body, timeout=30), status)
    _still_serving(roomy)


# ---- malformed bodies and values ----

def _deep(depth: int) -> bytes:
    return b'{"prompt": "ab", "tools": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("body, param", [
    (b"", None), (b"null", None), (b'"just a string"', None), (b"[" * 10_000 + b"]" * 10_000, None),
    (b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", None), (_deep(900), None), (_deep(5_000), None),
    (b'{"prompt": "\xff\xfe"}', None), (b'{"prompt": "\\ud800"}', "prompt"),
    (b'{"prompt": "ab", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    (b'{"prompt": "ab", "temperature": 1e309}', "temperature"), (b'{"prompt": "ab", "top_p": -1e309}', "top_p"),
    (b'{"prompt": "ab", "min_p": Infinity}', None), (b'{"prompt": "ab", "temperature": NaN}', None),
    (b'{"prompt": "ab", "seed": 4294967296}', "seed"), (b'{"prompt": "ab", "seed": -1}', "seed"),
    (b'{"prompt": "ab", "seed": 4294967295, "n": 2}', "seed"),
    (b'{"prompt": "ab", "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": "ab", "top_k": 1099511627776}', "top_k"), (b'{"prompt": "ab", "stop_token_ids": [4294967296]}',
                                                            "stop_token_ids"),
    (b'{"prompt": "ab", "stop_token_ids": [' + b"1," * 5000 + b"1]}", "stop_token_ids"),
    (b'{"prompt": "ab", "stop": [' + b'"s",' * 100 + b'"s"]}', "stop"),
    (b'{"prompt": [' + b"1.5," * 50_000 + b"1.5]}", "prompt"),
    (b'{"prompt": [' + b"1," * 50_000 + b"99999]}", "prompt"),
    (b'{"prompt": [' + b"[1]," * 100 + b"[1]]}", "prompt"), (b'{"prompt": ["a", "b"], "n": 40}', "prompt"),
    (b'{"prompt": "ab", "n": 100000000000000000000}', "n"),
    (b'{"messages": [' + b"7," * 50_000 + b"7]}", "messages[0]"),
    (b'{"prompt": "ab", "stream": true, "stream_options": {"include_usage": "yes"}}', "stream_options.include_usage"),
])
def test_malformed_bodies_are_4xx(url: str, body: bytes, param: str | None) -> None:
    path = "/v1/chat/completions" if body.startswith(b'{"messages"') else "/v1/completions"
    t0 = time.monotonic()
    r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
    assert time.monotonic() - t0 < 2
    err = _error(r, 400)
    assert param is None or err["param"] == param, err


def test_the_tokenizer_routes_refuse_the_same_way(url: str) -> None:
    _error(httpx.post(f"{url}/tokenize", content=b'{"prompt": "\\udfff"}',
                      headers={"content-type": "application/json"}), 400)
    _error(httpx.post(f"{url}/detokenize", json={"tokens": [1] * 1000 + [10**12]}), 400)
    _error(httpx.post(f"{url}/tokenize", content=b"[" * 5000, headers={"content-type": "application/json"}), 400)
    assert httpx.post(f"{url}/tokenize", json={"prompt": "é" * 30_000}).json()["count"] == 60_001


def test_a_client_gone_mid_upload_is_not_an_error(url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    with ServerLog() as log:
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 5000\r\n\r\n" + json.dumps({"prompt": "x" * 2000}).encode()[:2500])
        time.sleep(0.3)
        _still_serving(url)
    assert log.problems() == []


# ---- the sliced JSON decoder big bodies go through ----

# No subnormals: after the real engine's CPU kernels have run, the process flushes them to zero (hypothesis refuses).
_FLOATS = st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False)
_SCALARS = (st.none() | st.booleans() | st.integers(-10**20, 10**20) | _FLOATS
            | st.text(alphabet=st.sampled_from('ab,]["\\ {}:1é')))
_JSON = st.recursive(_SCALARS,
                     lambda inner: st.lists(inner, max_size=40) | st.dictionaries(st.text(max_size=3), inner,
                                                                                  max_size=4), max_leaves=300)


@settings(max_examples=150, deadline=None)
@given(_JSON, st.sampled_from([(",", ":"), (", ", ": ")]))
def test_sliced_json_reads_what_json_reads(value, separators) -> None:
    text = json.dumps(value, separators=separators)
    assert yielding_json.loads(text.encode()) == json.loads(text)


def test_sliced_json_fails_where_json_fails() -> None:
    for text in ["[1,]", "[[1],]", "[1 2]", "[1,2", "[[1,2]", '{"a": [1, NaN]}', "[" * 3000, "[1e400, Infinity]"]:
        with pytest.raises((ValueError, RecursionError)) as expected:
            json.loads(text, parse_constant=yielding_json.reject_constant)
        with pytest.raises(expected.type):
            yielding_json.loads(text.encode())
    ids = list(range(100_000))
    assert yielding_json.dumps_ints(ids) == json.dumps(ids, separators=(",", ":"))
    assert yielding_json.dumps_ints([]) == "[]"
