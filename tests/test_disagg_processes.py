"""Disaggregated serving as processes on loopback (-m slow): 2 prefill servers and 2 decode
servers (one of each kind TP 1, the other TP 2 on two CPU devices) and the router, each a `jaxserve` process. The
colocated engine's tokens from every pair; 64 streams at once, none lost; a prefill server killed with prompts in
flight and a decode server killed mid-stream are survived."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import pytest
from disagg_helpers import ENGINE_ARGS, ENGINE_FLAGS, launch, stream, wait_ready
from server_helpers import free_port

from jaxserve import LLM
from jaxserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = ["To be, or not to be, that is the question", "Now is the winter of our discontent " * 20, "O"]


@pytest.fixture(scope="module")
def cluster():
    ports = {name: free_port() for name in ("p0", "p1", "d0", "d1", "router")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    procs = {}
    try:
        for name, tp in (("p0", 1), ("p1", 2)):  # the second of each kind on 2 devices (TP 2): heads re-laid
            procs[name] = launch("serve", *ENGINE_FLAGS, "--port", str(ports[name]), "--tensor-parallel-size",
                                 str(tp), "--disaggregation-mode", "prefill", devices=tp)
        for name, tp in (("d0", 1), ("d1", 2)):
            procs[name] = launch("serve", *ENGINE_FLAGS, "--port", str(ports[name]), "--tensor-parallel-size",
                                 str(tp), "--disaggregation-mode", "decode", "--kv-transfer-timeout", "10", devices=tp)
        procs["router"] = launch("router", "--pd-disaggregation", "--prefill", url["p0"], url["p1"], "--decode",
                                 url["d0"], url["d1"], "--port", str(ports["router"]),
                                 "--health-check-interval", "1", "--stall-timeout", "30")
        for name in ("p0", "p1", "d0", "d1"):
            wait_ready(url[name], procs[name])
        wait_ready(url["router"], procs["router"], timeout=60)
        yield url, procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def colocated():
    return LLM(**ENGINE_ARGS)


def _text(llm: LLM, prompt: str, max_tokens: int) -> str:
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0]
    return llm.tokenizer.decode(out.outputs[0].token_ids)


def _complete(url: str, prompt: str, max_tokens: int) -> str:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                  "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_greedy_tokens_equal_the_colocated_engines(cluster, colocated):
    url, _ = cluster
    for prompt in PROMPTS:
        assert _complete(url["router"], prompt, 16) == _text(colocated, prompt, 16)


@pytest.mark.parametrize("prefill, decode", [("p0", "d0"), ("p0", "d1"), ("p1", "d0"), ("p1", "d1")])
def test_every_pair_of_tp_degrees_gives_the_colocated_tokens(cluster, colocated, prefill, decode):
    url, _ = cluster
    for prompt in PROMPTS:
        r = httpx.post(f"{url[decode]}/v1/completions", headers={"X-Jaxserve-Prefill": url[prefill]}, timeout=120,
                       json={"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == _text(colocated, prompt, 16)
    assert httpx.get(f"{url[decode]}/disagg/info").json()["counters"]["prefill_failures"] == 0


def test_64_concurrent_streams_lose_nothing(cluster):
    url, _ = cluster
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda i: stream(url["router"], f"stream {i} " * (1 + i % 9), max_tokens=12,
                                                 stream_options={"include_usage": True}), range(64)))
    for _, events in results:
        assert not any("error" in e for e in events)
        assert events[-1]["usage"]["completion_tokens"] == 12


def test_a_prefill_server_killed_with_prompts_in_flight_is_survived(cluster, colocated):
    url, procs = cluster
    victim = procs["p0"]
    victim.send_signal(signal.SIGSTOP)  # the prompts reach it and wait there
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_complete, url["router"], p, 8) for p in PROMPTS * 2]
        time.sleep(2)
        victim.kill()
        texts = [f.result(timeout=120) for f in futures]
    assert texts == [_text(colocated, p, 8) for p in PROMPTS * 2]
    tried = "".join(procs[d].log_path.read_text() for d in ("d0", "d1"))
    assert f"prefill on {url['p0']} failed" in tried  # some were sent to the killed one first
    assert _complete(url["router"], PROMPTS[0], 4) == _text(colocated, PROMPTS[0], 4)


def test_a_decode_server_killed_mid_stream_is_survived(cluster, colocated):
    url, procs = cluster
    events, error = [], []
    with httpx.stream("POST", f"{url['router']}/v1/completions", timeout=60,
                      json={"prompt": "a long one", "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(line)
            if "error" in line:
                error.append(line)
            if len(events) == 5:  # the stream is live on one decode server: kill the one that has it
                busy = [d for d in ("d0", "d1") if httpx.get(f"{url[d]}/metrics").text.count(
                    'jaxserve:num_requests_running{model_name="tiny"} 1.0')]
                assert len(busy) == 1
                procs[busy[0]].kill()
                killed_at = time.monotonic()
    assert len(error) == 1 and "failed mid-stream" in error[0] and time.monotonic() - killed_at < 10
    assert _complete(url["router"], PROMPTS[1], 8) == _text(colocated, PROMPTS[1], 8)  # the other one serves
