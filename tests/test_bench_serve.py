"""`jaxserve bench serve`: the in-process load driver on the session's tiny engine, and the HTTP client."""

import json
import math

import httpx
import pytest

from jaxserve.measure.bench.datasets import DatasetConfig, generate
from jaxserve.measure.bench.http_client import run_http
from jaxserve.measure.bench.load import LoadConfig, run_engine
from jaxserve.measure.bench.results import compute_metrics

VOCAB = 512


def _reqs(name: str, **kw):
    base = dict(name=name, num_prompts=6, input_len=24, output_len=5, seed=1)
    base.update(kw)
    return generate(DatasetConfig(**base), VOCAB, (257,))


def test_random_poisson_run_completes_with_exact_lengths(tiny_llm):
    reqs = _reqs("random", range_ratio=0.5)
    run = run_engine(tiny_llm.engine, reqs, LoadConfig(request_rate=200.0, seed=0), salt="t-random")
    assert [r.output_len for r in run.records] == [r.output_len for r in reqs]
    assert all(r.success and r.ttft > 0 and r.latency >= r.ttft for r in run.records)
    assert all(len(r.itl) == r.output_len - 1 for r in run.records)
    m = compute_metrics(run.records, run.duration)
    assert m["completed"] == 6 and m["failed"] == 0 and m["output_throughput"] > 0
    assert not tiny_llm.engine.has_unfinished_requests()
    assert run.steps and sum(s.num_decodes for s in run.steps) > 0


def test_shared_prefix_hits_the_cache(tiny_llm):
    reqs = _reqs("shared-prefix", num_prompts=8, input_len=48, prefix_len=32, num_prefixes=2)
    run = run_engine(tiny_llm.engine, reqs, LoadConfig(request_rate=100.0, seed=0), salt="t-prefix")
    m = compute_metrics(run.records, run.duration)
    assert m["prefix_cache_hit_rate"] > 0.2


def test_multi_turn_follows_its_conversation(tiny_llm):
    reqs = _reqs("multi-turn", num_prompts=6, turns=3, input_len=8, output_len=3)
    run = run_engine(tiny_llm.engine, reqs, LoadConfig(), salt="t-multi")
    recs = run.records
    for i, r in enumerate(reqs):
        if r.wait_for is not None:
            prev = recs[r.wait_for]
            assert recs[i].arrival >= prev.arrival + prev.latency - 1e-6
    assert all(r.success for r in recs)
    later = [rec.cached_tokens for rec, req in zip(recs, reqs, strict=True) if req.wait_for is not None]
    assert max(later) > 0  # follow-ups reuse their conversation's pages


def test_multi_turn_sends_back_the_models_own_answer(tiny_llm):
    reqs = _reqs("multi-turn", num_prompts=2, turns=2, input_len=8, output_len=24)
    run = run_engine(tiny_llm.engine, reqs, LoadConfig(), salt="t-answer")
    # Turn 1 computed its 8 prompt tokens and 23 of its 24 answer tokens: one whole page (16) and the 15
    # tokens of the next, and turn 2 finds them only if the answer it sends back is the one the model gave.
    assert run.records[1].cached_tokens == 31


def test_max_concurrency_is_respected(tiny_llm):
    reqs = _reqs("random", num_prompts=6)
    run = run_engine(tiny_llm.engine, reqs, LoadConfig(max_concurrency=2), salt="t-conc")
    spans = [(r.arrival, r.arrival + r.latency) for r in run.records]
    for t, _ in spans:
        in_flight = sum(a <= t + 1e-9 and t < b - 1e-9 for a, b in spans)
        assert in_flight <= 2


def test_long_prompt_arrives_mid_decode(tiny_llm):
    reqs = _reqs("long-prompt", num_prompts=3, input_len=16, output_len=20, long_prompt_len=100)
    run = run_engine(tiny_llm.engine, reqs, LoadConfig(), salt="t-long")
    first, long_rec = run.records[0], run.records[-1]
    assert long_rec.role == "long" and long_rec.success
    t_warm = run.token_times[0][reqs[-1].wait_tokens - 1]
    assert long_rec.arrival >= t_warm - 1e-6
    assert long_rec.arrival < first.arrival + first.latency  # it landed while the decodes were running


def _sse_server(cached: int = 3):
    """An httpx mock of an OpenAI streaming /v1/completions that echoes one text chunk per token."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "mock"}]})
        body = json.loads(request.content)
        assert body["stream"] and body["ignore_eos"] and body["model"] == "mock"
        n = body["max_tokens"]
        assert body["logprobs"] == 0
        # Every other token has no text (as random ids through a byte tokenizer): its logprobs still count.
        chunks = [{"choices": [{"index": 0, "text": "" if i % 2 else f"t{i}", "logprobs": {"tokens": [f"t{i}"]}}]}
                  for i in range(n)]
        chunks.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                                                "prompt_tokens_details": {"cached_tokens": cached}}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_http_client_measures_streams():
    reqs = _reqs("random", num_prompts=4, output_len=6)
    run = run_http("http://mock", reqs, LoadConfig(request_rate=math.inf), transport=_sse_server())
    assert len(run.records) == 4
    for r in run.records:
        assert r.success and r.output_len == 6 and len(r.itl) == 5 and r.cached_tokens == 3
        assert 0 <= r.ttft <= r.latency
    m = compute_metrics(run.records, run.duration)
    assert m["completed"] == 4 and m["prefix_cache_hit_rate"] == pytest.approx(3 / 24)


def test_http_errors_become_failed_requests():
    transport = httpx.MockTransport(lambda req: httpx.Response(400, json={"error": {"message": "bad"}}))
    run = run_http("http://mock", _reqs("random", num_prompts=2), LoadConfig(), model="m", transport=transport)
    assert all(not r.success and "HTTP 400" in r.error for r in run.records)
    assert compute_metrics(run.records, run.duration)["failed"] == 2


def test_a_server_that_cannot_name_its_model_is_one_clear_error():
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("All connection attempts failed", request=request)

    for transport in (httpx.MockTransport(down), httpx.MockTransport(lambda req: httpx.Response(200, json={}))):
        with pytest.raises(ValueError, match="cannot learn the served model from http://mock/v1/models"):
            run_http("http://mock", _reqs("random", num_prompts=2), LoadConfig(), transport=transport)


def test_sampling_flags_reach_the_engine_and_the_server(tiny_llm):
    """Nucleus sampling with a seeded engine still gives exact lengths; over HTTP the flags go in the body,
    top_k and min_p (vLLM's extensions) only when set; bad values fail where the flags are read."""
    reqs = _reqs("random", num_prompts=3)
    load = LoadConfig(temperature=0.8, top_p=0.9)
    run = run_engine(tiny_llm.engine, reqs, load, salt="t-sampling")
    assert [r.output_len for r in run.records] == [5, 5, 5] and all(r.success for r in run.records)
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(400, json={"error": {"message": "recorded"}})

    run_http("http://mock", reqs[:1], load, model="m", transport=httpx.MockTransport(handler))
    assert bodies[0]["temperature"] == 0.8 and bodies[0]["top_p"] == pytest.approx(0.9)
    assert "top_k" not in bodies[0] and "min_p" not in bodies[0]
    with pytest.raises(ValueError, match="top_p"):
        LoadConfig(top_p=0.0)
