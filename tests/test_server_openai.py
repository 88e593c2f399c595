"""The server against the real engine (`tiny`), through the official `openai` client and raw HTTP.

One live server (uvicorn in a thread, free loopback port) for the whole module.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest
from server_helpers import engine_server, sample, scrape, wait_until

from jaxserve.config.engine import EngineConfig

SERVER_ENGINE_ARGS = dict(max_num_seqs=64, max_num_batched_tokens=256, chunk_size=64, page_size=16,
                          kv_cache_memory=16 * 2**20, max_model_len=2048)
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server():
    with engine_server(EngineConfig(model="tiny", **SERVER_ENGINE_ARGS)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_models_health_version(server, client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    version = httpx.get(f"{server.url}/version").json()
    assert version["version"] and version["attention_backend"] == "cpu"  # what "auto" resolved to on this CPU
    assert version["quantization"] == "none" and version["kv_cache_dtype"] == "auto"


def test_completion_with_usage(client) -> None:
    r = client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=7, **GREEDY)
    choice = r.choices[0]
    assert r.object == "text_completion" and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == 18  # BOS + 17 bytes
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == 25
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_repeated_prompt_reports_cached_tokens(client) -> None:
    prompt = "A long shared prefix that fills several pages of the KV cache. " * 2
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_streamed_completion_matches_whole_one(client) -> None:
    whole = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, **GREEDY)
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_chat_whole_and_streamed(client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, **GREEDY)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 6 and whole.usage.prompt_tokens > 8
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6,
                                                 stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_n_choices_with_seed_are_reproducible_and_distinct(client) -> None:
    kw = dict(model="tiny", prompt="The weather today", max_tokens=10, n=3, seed=1234, temperature=1.0,
              extra_body={"ignore_eos": True})
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3
    assert first.usage.completion_tokens == 30
    other = client.completions.create(**{**kw, "seed": 99, "n": 1})
    assert other.choices[0].text != texts[0]


def test_several_prompts_times_n(client) -> None:
    r = client.completions.create(model="tiny", prompt=["first", "sec"], n=2, max_tokens=3, **GREEDY)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 6 + 4 and r.usage.completion_tokens == 12


def test_streamed_chat_with_n_choices(client) -> None:
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2,
                                                 max_tokens=4, seed=5, stream=True, **GREEDY))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"


def test_stop_string(client) -> None:
    kw = dict(model="tiny", prompt="abc", max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    for seed in range(20):  # the random-weight model emits many non-byte tokens; find a printable character
        text = client.completions.create(seed=seed, **kw).choices[0].text
        stops = [ch for ch in text[1:] if ch.isprintable() and ch != "\ufffd"]
        if stops:
            break
    r = client.completions.create(seed=seed, stop=[stops[0]], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stops[0])]


def test_logprobs(client) -> None:
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=4, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       logprobs=True, top_logprobs=2, **GREEDY)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_top_logprobs_never_collapse_and_keep_exact_bytes(client) -> None:
    r = client.completions.create(model="tiny", prompt="caf\u00e9 \u2014 na\u00efve", max_tokens=6, logprobs=20,
                                  **GREEDY)
    assert all(len(top) == 20 for top in r.choices[0].logprobs.top_logprobs)  # byte tokens have distinct keys
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       logprobs=True, top_logprobs=20, **GREEDY)
    for tok in c.choices[0].logprobs.content:
        assert len({t.token for t in tok.top_logprobs}) == 20
        for t in tok.top_logprobs:
            if len(t.bytes) == 1 and t.bytes[0] >= 0x80:  # part of a character: its byte, OpenAI's form
                assert t.token == f"bytes:\\x{t.bytes[0]:02x}"
            elif not t.bytes:
                assert t.token.startswith("token_id:")  # an unused id of tiny's vocabulary


def test_penalties_bias_and_min_tokens_through_the_api(client) -> None:
    forced = client.completions.create(model="tiny", prompt="abc", max_tokens=5, logit_bias={"120": 100},
                                       **GREEDY)
    assert forced.choices[0].text == "xxxxx"
    free = client.completions.create(model="tiny", prompt="abc", max_tokens=16, **GREEDY).choices[0].text
    penalized = client.completions.create(model="tiny", prompt="abc", max_tokens=16, frequency_penalty=2.0,
                                          presence_penalty=2.0, **GREEDY).choices[0].text
    assert len(set(penalized)) > len(set(free))
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0,
                                  extra_body={"min_tokens": 8, "bad_words": ["x"], "logit_bias": {"120": 50},
                                              "repetition_penalty": 1.2})
    assert r.usage.completion_tokens == 8 and "x" not in r.choices[0].text


@pytest.mark.parametrize("body, status, param", [
    (b'{"prompt": "hi", "max_tokens": ', 400, None),
    (b'["not", "an", "object"]', 400, None),
    (b'{"prompt": "hi", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 5.5}', 400, "max_tokens"),
    (b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    (b'{"prompt": 12}', 400, "prompt"),
    (b'{"max_tokens": 5}', 400, "prompt"),
    (b'{"prompt": "hi", "max_tokens": -1}', 400, "max_tokens"),
    (b'{"prompt": "hi", "temperature": -0.5}', 400, "temperature"),
    (b'{"prompt": "hi", "top_p": 1.5}', 400, "top_p"),
    (b'{"prompt": "hi", "top_p": 0}', 400, "top_p"),
    (b'{"prompt": "hi", "n": 0}', 400, "n"),
    (b'{"prompt": "hi", "best_of": 4}', 400, "best_of"),
    (b'{"prompt": "hi", "frequency_penalty": 2.5}', 400, "frequency_penalty"),
    (b'{"prompt": "hi", "repetition_penalty": 0}', 400, "repetition_penalty"),
    (b'{"prompt": "hi", "logit_bias": {"abc": 1}}', 400, "logit_bias"),
    (b'{"prompt": "hi", "logit_bias": {"600": 1}}', 400, "logit_bias"),
    (b'{"prompt": "hi", "min_tokens": 9, "max_tokens": 3}', 400, "min_tokens"),
    (b'{"prompt": [1, 2, 100000]}', 400, "prompt"),
    (b'{"prompt": []}', 400, "prompt"),
    (b'{"prompt": "hi", "temperature": NaN}', 400, None),
    (b'{"prompt": "hi", "logprobs": 21}', 400, "logprobs"),
    (b'{"prompt": "hi", "model": "gpt-4"}', 404, "model"),
    # Values that would once have been cut or reached the engine's int32 arrays (and killed its loop):
    (b'{"prompt": "hi", "seed": 4294967296}', 400, "seed"),
    (b'{"prompt": "hi", "temperature": 1e309}', 400, "temperature"),
    (b'{"prompt": "hi", "top_k": 4294967296}', 400, "top_k"),
    (b'{"prompt": "hi", "stop_token_ids": [4294967296]}', 400, "stop_token_ids"),
])
def test_bad_completion_requests(server, body: bytes, status: int, param: str | None) -> None:
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_bad_chat_requests(server) -> None:
    url = f"{server.url}/v1/chat/completions"
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "user"}], "top_logprobs": 2},
                                                         "top_logprobs"),
                        ({"messages": [{"role": "narrator", "content": "x"}]}, "messages[0].role"),
                        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                         "tools[0].function"),
                        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream")]:
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.post(url, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).status_code == 200


def test_context_length_error(server, client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x" * 2000, max_tokens=100)
    assert "maximum context length is 2048 tokens" in str(e.value)
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "y" * 2100}], "stream": True})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


def test_tokenize_detokenize(server) -> None:
    toks = httpx.post(f"{server.url}/tokenize", json={"prompt": "héllo"}).json()
    assert toks["count"] == len(toks["tokens"]) and toks["max_model_len"] == 2048
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"]
    assert text.endswith("héllo")
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2


def test_metrics_names(server, client) -> None:
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3, **GREEDY)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ["time_to_first_token_seconds", "inter_token_latency_seconds",
                 "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "iteration_tokens_total"]:
        assert f'jaxserve:{name}_count{{model_name="tiny"}}' in text, name
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total"]:
        assert f'jaxserve:{name}{{model_name="tiny"}}' in text, name
    assert 'jaxserve:request_success_total{finished_reason="length",model_name="tiny"}' in text


def _idle(url: str) -> bool:
    m = scrape(url)
    return m["jaxserve:num_requests_running"] == 0 and m["jaxserve:kv_cache_usage_perc"] == 0


def test_streaming_client_disconnect_frees_everything(server) -> None:
    body = {"prompt": "disconnect me", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        assert scrape(server.url)["jaxserve:num_requests_running"] >= 1
    assert wait_until(lambda: _idle(server.url), timeout=5)
    assert sample(server.url, "jaxserve:request_success_total", finished_reason="abort") >= 1


def test_non_streaming_client_disconnect_frees_everything(server) -> None:
    aborted = sample(server.url, "jaxserve:request_success_total", finished_reason="abort")
    body = json.dumps({"prompt": "bye", "max_tokens": 2000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_until(lambda: scrape(server.url)["jaxserve:num_requests_running"] >= 1, timeout=5)
    assert wait_until(lambda: _idle(server.url), timeout=5)
    assert sample(server.url, "jaxserve:request_success_total", finished_reason="abort") == aborted + 1


def test_load_64_concurrent_streaming_clients(server) -> None:
    clients, per_client, max_tokens = 64, 4, 16

    async def one_client(i: int, http: httpx.AsyncClient) -> list[tuple[int, int, str | None]]:
        results = []
        for j in range(per_client):
            body = {"prompt": f"client {i} request {j}: " + "z" * (i % 20), "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0.8, "seed": i * 100 + j}
            async with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                status, events = r.status_code, [line async for line in r.aiter_lines() if line]
            chunks = [json.loads(e[6:]) for e in events[:-1]]
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
            assert events[-1] == "data: [DONE]" and chunks[-1]["usage"]["completion_tokens"] == max_tokens
            results.append((status, chunks[-1]["usage"]["completion_tokens"], finish))
        return results

    async def main() -> list[tuple[int, int, str | None]]:
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            runs = await asyncio.wait_for(asyncio.gather(*(one_client(i, http) for i in range(clients))), 90)
        return [r for run in runs for r in run]

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert len(results) == clients * per_client
    assert all(r == (200, max_tokens, "length") for r in results)
    assert time.monotonic() - t0 < 90
    assert wait_until(lambda: _idle(server.url), timeout=5)
