"""Disaggregated serving across servers, fast: a prefill server, a decode server and the router in this process
(the KV moved by jax.experimental.transfer over loopback) give the colocated engine's tokens. The process-level
cases (kills, many streams) are in test_disagg_processes.py (-m slow)."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from cli_helpers import run_cli
from disagg_helpers import ENGINE_ARGS, complete, role_server, router_server, stream

from jaxserve import LLM
from jaxserve.core.sampling_params import SamplingParams

PROMPTS = ["To be, or not to be, that is the question", "Now is the winter of our discontent " * 12, "O"]


@pytest.fixture(scope="module")
def stack():
    """A prefill server, a decode server pulling chunk by chunk (the router's), one pulling whole prompts."""
    with (role_server("prefill") as prefill, role_server("decode") as decode,
          role_server("decode", chunked_transfer=False) as whole,
          router_server(pd_disaggregation=True, prefill_urls=(prefill.url,), decode_urls=(decode.url,)) as router):
        router.whole = whole
        yield prefill, decode, router


@pytest.fixture(scope="module")
def colocated():
    return LLM(**ENGINE_ARGS)


def _tokens(llm: LLM, prompt: str, **params) -> list[int]:
    out = llm.generate([prompt], SamplingParams(ignore_eos=True, **params))[0]
    return out.outputs[0].token_ids


def test_greedy_and_seeded_tokens_equal_the_colocated_engines(stack, colocated):
    prefill, decode, router = stack
    exports = prefill.engine.exporter.counters["kv_exports"]
    direct = {"X-Jaxserve-Prefill": prefill.url}
    for prompt in PROMPTS:
        for params in (dict(temperature=0.0, max_tokens=12), dict(temperature=1.0, seed=11, max_tokens=12)):
            want = colocated.tokenizer.decode(_tokens(colocated, prompt, **params))
            for url, headers in ((router.url, {}), (router.whole.url, direct)):
                r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "ignore_eos": True, **params},
                               headers=headers, timeout=120).json()
                assert r["choices"][0]["text"] == want, (prompt, params, url)
    for server in (decode, router.whole):  # every prompt was prefilled on the prefill server and moved
        assert server.engine.stats()["kv_imports"] == 2 * len(PROMPTS)
    # Chunk by chunk, the long prompt moved in several blocks; whole, every prompt in one.
    assert prefill.engine.exporter.counters["kv_exports"] - exports > 4 * len(PROMPTS)


def test_a_stream_through_the_router_matches_the_whole_response(stack):
    _, _, router = stack
    whole = complete(router.url, PROMPTS[0], temperature=0.0, max_tokens=10)
    text, events = stream(router.url, PROMPTS[0], temperature=0.0, max_tokens=10)
    assert text == "".join(whole) and not any("error" in e for e in events)


def test_concurrent_streams_all_finish(stack):
    _, decode, router = stack
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: stream(router.url, f"request {i} " * (i + 1), max_tokens=6),
                                range(16)))
    assert all(len(events) >= 1 and events[-1]["choices"][0]["finish_reason"] == "length"
               for _, events in results)
    assert decode.engine.engine.stats()["num_running"] == 0


def test_the_decode_server_prefills_itself_what_cannot_move(stack, colocated):
    """Prompt logprobs stay where the prompt runs: such a request is prefilled on the decode server."""
    _, decode, router = stack
    before = decode.engine.stats()["kv_imports"]
    r = httpx.post(f"{router.url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                                                         "prompt_logprobs": 1, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == colocated.tokenizer.decode(_tokens(colocated, PROMPTS[0],
                                                                                 temperature=0.0, max_tokens=4))
    assert decode.engine.stats()["kv_imports"] == before


def test_a_dead_prefill_server_is_a_clear_503_not_a_hang(stack):
    _, decode, _ = stack
    r = httpx.post(f"{decode.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers={"X-Jaxserve-Prefill": "http://127.0.0.1:9"}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "prefill_unavailable"
    assert "127.0.0.1:9" in r.json()["error"]["message"]


@pytest.mark.parametrize("args, mentions", [
    (["--disaggregation-mode", "sideways"], "--disaggregation-mode"),
    (["--prefill-url", "http://127.0.0.1:1"], "--prefill-url"),
    (["--disaggregation-mode", "decode", "--async-scheduling"], "synchronous loop"),
    (["--disaggregation-mode", "prefill", "--disaggregate"], "one engine per process"),
])
def test_bad_disaggregation_flags_are_one_line_and_exit_2(args, mentions):
    code, err = run_cli("serve", "--port", "0", *args)
    assert code == 2 and mentions in err and len(err.strip().splitlines()) == 1, err


def test_a_chat_through_the_router_equals_one_prefilled_where_it_decodes(stack):
    """Chat: the decode server renders the template and tokenizes; the prefill server gets the ids."""
    _, _, router = stack
    body = {"messages": [{"role": "user", "content": "Speak the speech, I pray you"}], "max_tokens": 8,
            "temperature": 0}
    imports = router.whole.engine.stats()["kv_imports"]
    routed = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=120)
    local = httpx.post(f"{router.whole.url}/v1/chat/completions", json=body, timeout=120)  # no prefill server named
    assert routed.status_code == local.status_code == 200
    assert router.whole.engine.stats()["kv_imports"] == imports  # prefilled where it decoded
    assert routed.json()["choices"][0]["message"] == local.json()["choices"][0]["message"]
