"""Serving model: the closed form against the discrete-event simulation, and its basic behaviour."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelspec.spec import PRESETS
from planner.hardware import CATALOG
from planner.serving import ServingConfig, Workload, predict_serving
from planner.simulate import simulate

H100, CPU = CATALOG["h100-sxm"], CATALOG["cpu"]
L8B, SMALL = PRESETS["llama-3.1-8b"], PRESETS["small"]


def capacity(spec, hw, wl, cfg):
    return predict_serving(spec, hw, wl, cfg).capacity_requests_per_s


@pytest.mark.parametrize(("spec", "hw", "input_len", "output_len", "cfg", "load", "n"), [
    (L8B, H100, 1024, 256, ServingConfig(), 0.3, 600),
    (L8B, H100, 1024, 256, ServingConfig(), 0.75, 2000),
    (L8B, H100, 4096, 128, ServingConfig(chunk_size=512), 0.6, 1000),  # chunked long prompts
    (SMALL, CPU, 256, 64, ServingConfig(chunk_size=256, dtype="fp32", max_num_seqs=16), 0.5, 2500),  # prefill-bound
])
def test_closed_form_matches_simulation_below_80_percent_load(spec, hw, input_len, output_len, cfg, load, n):
    base = Workload(input_len, output_len, request_rate=1.0)
    wl = Workload(input_len, output_len, request_rate=load * capacity(spec, hw, base, cfg))
    pred = predict_serving(spec, hw, wl, cfg)
    sim = simulate(spec, hw, wl, cfg, num_requests=n, seed=0)
    assert pred.stable
    assert pred.ttft.mean == pytest.approx(sim.ttft.mean, rel=0.10)
    assert pred.tpot.mean == pytest.approx(sim.tpot.mean, rel=0.10)


def test_single_client_sees_no_queue():
    # One closed-loop client: TTFT is its own prefill step, TPOT the batch-1 decode step.
    cfg = ServingConfig(chunk_size=4096)
    pred = predict_serving(L8B, H100, Workload(1024, 128, concurrency=1), cfg)
    sim = simulate(L8B, H100, Workload(1024, 128, concurrency=1), cfg, num_requests=20)
    assert pred.ttft.mean == pytest.approx(sim.ttft.mean, rel=0.01)
    assert pred.tpot.mean == pytest.approx(sim.tpot.mean, rel=0.01)


def test_load_raises_latency_and_overload_is_reported():
    cfg = ServingConfig()
    cap = capacity(L8B, H100, Workload(1024, 256, request_rate=1.0), cfg)
    light = predict_serving(L8B, H100, Workload(1024, 256, request_rate=0.2 * cap), cfg)
    heavy = predict_serving(L8B, H100, Workload(1024, 256, request_rate=0.9 * cap), cfg)
    over = predict_serving(L8B, H100, Workload(1024, 256, request_rate=1.5 * cap), cfg)
    assert light.ttft.mean < heavy.ttft.mean and light.tpot.mean < heavy.tpot.mean
    assert light.ttft.p50 <= light.ttft.p90 <= light.ttft.p99
    assert not over.stable and math.isinf(over.ttft.mean) and over.goodput_requests_per_s == 0
    assert "overloaded" in over.bottleneck


def test_goodput_counts_only_requests_within_slos():
    wl = Workload(1024, 256, concurrency=64)
    free = predict_serving(L8B, H100, wl, ServingConfig())
    strict = predict_serving(L8B, H100, wl, ServingConfig(), ttft_slo_ms=free.ttft.p50, tpot_slo_ms=1e9)
    assert free.goodput_requests_per_s == pytest.approx(free.requests_per_s)
    assert strict.goodput_requests_per_s == pytest.approx(0.5 * free.requests_per_s, rel=0.05)


def test_prefix_hits_shorten_ttft_and_replicas_split_the_load():
    cfg = ServingConfig(replicas=2)
    cold = predict_serving(L8B, H100, Workload(4096, 128, request_rate=4), cfg)
    warm = predict_serving(L8B, H100, Workload(4096, 128, request_rate=4, prefix_hit=0.75), cfg)
    assert warm.ttft.mean < 0.5 * cold.ttft.mean
    one = predict_serving(L8B, H100, Workload(4096, 128, request_rate=2), ServingConfig())
    assert cold.ttft.mean == pytest.approx(one.ttft.mean, rel=1e-6)  # 4 req/s over 2 replicas = 2 req/s each


def test_workload_rejects_bad_input():
    with pytest.raises(ValueError):
        Workload(0, 10)
    with pytest.raises(ValueError):
        Workload(10, 10, request_rate=1, concurrency=2)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(st.floats(0.2, 0.7), st.sampled_from([256, 1024, 2048]), st.sampled_from([128, 256]))
def test_closed_form_tracks_simulation_property(load, input_len, output_len):
    cfg = ServingConfig(chunk_size=2048)
    base = Workload(input_len, output_len, request_rate=1.0)
    wl = Workload(input_len, output_len, request_rate=load * capacity(L8B, H100, base, cfg))
    pred = predict_serving(L8B, H100, wl, cfg)
    sim = simulate(L8B, H100, wl, cfg, num_requests=1500, seed=0)
    assert pred.ttft.mean == pytest.approx(sim.ttft.mean, rel=0.10)
    assert pred.tpot.mean == pytest.approx(sim.tpot.mean, rel=0.10)


def test_simulation_replays_a_given_arrival_trace():
    """Requests far apart see an empty engine; a burst at one instant queues (the report replays its runs' traces)."""
    spec, hw, cfg = PRESETS["small"], CATALOG["cpu"], ServingConfig(max_num_seqs=8, chunk_size=512, dtype="fp32")
    wl = Workload(input_len=128, output_len=8, request_rate=1.0)
    apart = simulate(spec, hw, wl, cfg, arrival_times=[0.0, 100.0, 200.0], warmup_fraction=0.0)
    lone = simulate(spec, hw, Workload(input_len=128, output_len=8, concurrency=1), cfg, num_requests=1,
                    warmup_fraction=0.0)
    assert apart.num_requests == 3
    assert apart.ttft.mean == pytest.approx(lone.ttft.mean, rel=1e-6)
    burst = simulate(spec, hw, wl, cfg, arrival_times=[0.0] * 6, warmup_fraction=0.0)
    assert burst.num_requests == 6 and burst.ttft.mean > apart.ttft.mean
