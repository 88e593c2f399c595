"""vLLM-style benchmark results: metric definitions on records with known timestamps, JSON keys, summary."""

import json

import pytest

from jaxserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.measure.bench.load import _record_from_output
from jaxserve.measure.bench.results import RequestRecord, compute_metrics, format_summary, meets_slos, parse_goodput

VLLM_KEYS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts",
             "itls", "latencies", "errors"] + [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                                               for s in ("mean", "median", "p99", "std")]


def _records():
    # a: arrival 0, tokens at 0.1, 0.2, 0.4 -> TTFT 0.1, gaps 0.1, 0.2, E2E 0.4, TPOT 0.15
    a = RequestRecord(prompt_len=10, success=True, output_len=3, ttft=0.1, itl=[0.1, 0.2], latency=0.4,
                      cached_tokens=4)
    # b: one token at 0.3 -> no TPOT
    b = RequestRecord(prompt_len=20, success=True, output_len=1, ttft=0.3, itl=[], latency=0.3, cached_tokens=0)
    c = RequestRecord(prompt_len=5, success=False, error="boom")
    return [a, b, c]


def test_metric_definitions():
    r = compute_metrics(_records(), duration=2.0, slos={"ttft": 200.0})
    assert r["completed"] == 2 and r["failed"] == 1
    assert r["total_input_tokens"] == 30 and r["total_output_tokens"] == 4
    assert r["request_throughput"] == pytest.approx(1.0)
    assert r["output_throughput"] == pytest.approx(2.0)
    assert r["total_token_throughput"] == pytest.approx(17.0)
    assert r["mean_ttft_ms"] == pytest.approx(200.0) and r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["mean_tpot_ms"] == pytest.approx(150.0)  # (E2E - TTFT) / (out - 1), only requests with >= 2 tokens
    assert r["mean_itl_ms"] == pytest.approx(150.0) and r["p99_itl_ms"] == pytest.approx(199.0)
    assert r["mean_e2el_ms"] == pytest.approx(350.0)
    assert r["request_goodput"] == pytest.approx(0.5)  # only a meets TTFT <= 200 ms
    assert r["prefix_cache_hit_rate"] == pytest.approx(4 / 30)
    assert r["errors"] == ["", "", "boom"] and r["itls"][0] == [0.1, 0.2]
    for key in VLLM_KEYS:
        assert key in r, key
    json.dumps(r)


def test_goodput_slos():
    a, b, _ = _records()
    assert meets_slos(a, {"tpot": 150.1}) and not meets_slos(a, {"tpot": 149.9})
    assert meets_slos(b, {"tpot": 1.0})  # a single token has no TPOT to miss
    assert not meets_slos(a, {"e2el": 399.0})
    assert parse_goodput(["ttft:500", "tpot:50 e2el:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    for bad in (["ttft"], ["foo:1"], ["ttft:x"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_summary_looks_like_vllm():
    r = compute_metrics(_records(), duration=2.0, slos={"ttft": 200.0})
    text = format_summary(r)
    assert "Serving Benchmark Result" in text
    for label in ("Successful requests:", "Benchmark duration (s):", "Request goodput (req/s):", "Mean TTFT (ms):",
                  "P99 TPOT (ms):", "Median ITL (ms):", "Mean E2EL (ms):", "Prefix cache hit rate (%):"):
        assert label in text


def test_record_from_engine_output():
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.05, first_token_time=10.2, finish_time=10.5,
                       token_times=[10.2, 10.3, 10.5], num_cached_tokens=16)
    out = RequestOutput(request_id="x", prompt=None, prompt_token_ids=[1] * 32,
                        outputs=[CompletionOutput(0, "", [1, 2, 3], finish_reason="length")], finished=True,
                        metrics=m, num_cached_tokens=16)
    rec = _record_from_output(out, 32, start=9.0, role="request")
    assert rec.success and rec.output_len == 3 and rec.cached_tokens == 16
    assert rec.ttft == pytest.approx(0.2) and rec.latency == pytest.approx(0.5) and rec.arrival == pytest.approx(1.0)
    assert rec.itl == pytest.approx([0.1, 0.2]) and rec.tpot == pytest.approx(0.15)
    assert rec.tpot == pytest.approx(m.tpot)
