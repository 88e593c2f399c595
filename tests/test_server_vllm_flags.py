"""What a vLLM user's habits find in the server: browsers' CORS preflights answered before the API key, the
`--max-logprobs` bound, and vLLM's per-request metric families (fake engine, so it stays fast)."""

from __future__ import annotations

import httpx
import pytest
from server_fake_engine import FakeEngine
from server_helpers import LiveServer

from jaxserve.server.app import build_app
from jaxserve.server.cors import CORSConfig
from jaxserve.server.limits import ServerLimits

PREFLIGHT = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.fixture(scope="module")
def keyed():
    limits = ServerLimits(api_keys=("k1",), max_logprobs=3)
    with LiveServer(build_app(FakeEngine(max_model_len=512), limits=limits), limits) as server:
        yield server


def test_a_preflight_is_answered_before_the_api_key(keyed) -> None:
    r = httpx.options(f"{keyed.url}/v1/completions", headers=PREFLIGHT)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    # the request itself still needs the key, and its 401 carries CORS headers a browser can read
    r = httpx.post(f"{keyed.url}/v1/completions", json={"prompt": "a"}, headers={"Origin": "https://ui.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_bound_who_may_call() -> None:
    cors = CORSConfig(allowed_origins=("https://ok.example",))
    with LiveServer(build_app(FakeEngine(), cors=cors)) as server:
        ok = httpx.options(f"{server.url}/v1/models", headers={**PREFLIGHT, "Origin": "https://ok.example"})
        other = httpx.options(f"{server.url}/v1/models", headers=PREFLIGHT)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_logprobs_past_max_logprobs_are_a_400_naming_the_flag(keyed) -> None:
    auth = {"Authorization": "Bearer k1"}
    r = httpx.post(f"{keyed.url}/v1/completions", headers=auth,
                   json={"prompt": "abc", "max_tokens": 2, "logprobs": 4})
    assert r.status_code == 400 and "--max-logprobs 3" in r.json()["error"]["message"]
    r = httpx.post(f"{keyed.url}/v1/completions", headers=auth,
                   json={"prompt": "abc", "max_tokens": 2, "logprobs": 3})
    assert r.status_code == 200


def test_vllms_request_metric_families(keyed) -> None:
    auth = {"Authorization": "Bearer k1"}
    before = sample_all(keyed.url, auth)
    r = httpx.post(f"{keyed.url}/v1/completions", headers=auth, json={"prompt": "abcd", "max_tokens": 3, "n": 2})
    assert r.status_code == 200
    after = sample_all(keyed.url, auth)
    grew = {name: after[name] - before.get(name, 0.0) for name in after}
    assert grew["jaxserve:request_params_n_sum"] == 2 and grew["jaxserve:request_params_n_count"] == 1
    assert grew["jaxserve:request_params_max_tokens_sum"] == 3
    assert grew["jaxserve:request_prompt_tokens_count"] == 2  # one per engine sequence, as vLLM's per request
    assert grew["jaxserve:request_generation_tokens_sum"] == 6
    assert grew["jaxserve:request_inference_time_seconds_count"] == 2


def sample_all(url: str, headers: dict[str, str]) -> dict[str, float]:
    """The unlabelled-by-bucket samples of /metrics (histogram sums and counts), by name."""
    out = {}
    for line in httpx.get(f"{url}/metrics", headers=headers).text.splitlines():
        if line.startswith("jaxserve:") and ("_sum{" in line or "_count{" in line):
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out

