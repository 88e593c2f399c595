"""Closed loops as benchmarks run them: the waves' closed form (planner/closed_loop.py) against the simulator."""

import time

import numpy as np
import pytest

from modelspec.spec import PRESETS
from planner.hardware import CATALOG
from planner.serving import ServingConfig, Workload, predict_serving
from planner.simulate import simulate

H100, CPU = CATALOG["h100-sxm"], CATALOG["cpu"]
L8B, SMALL = PRESETS["llama-3.1-8b"], PRESETS["small"]


def both(spec, hw, wl, cfg):
    return predict_serving(spec, hw, wl, cfg), simulate(spec, hw, wl, cfg)


@pytest.mark.parametrize(("spec", "hw", "lengths", "clients", "cfg"), [
    (L8B, H100, (1024, 128), 16, ServingConfig(chunk_size=8192)),  # cohorts of 7, 7 and 2 prompts
    (L8B, H100, (4096, 256), 32, ServingConfig(chunk_size=2048)),  # prompts longer than a step: one stream
    (L8B, H100, (2048, 64), 64, ServingConfig(chunk_size=4096)),  # no idle step: the first wave's groups stay
    (L8B, H100, (512, 8), 128, ServingConfig(chunk_size=2048)),  # prefill-bound
    (SMALL, CPU, (128, 32), 16, ServingConfig(chunk_size=512, dtype="fp32")),
])
def test_a_benchmark_run_of_clients_in_waves_matches_the_simulation(spec, hw, lengths, clients, cfg):
    wl = Workload(*lengths, concurrency=clients, num_prompts=5 * clients)
    pred, sim = both(spec, hw, wl, cfg)
    assert pred.ttft.mean == pytest.approx(sim.ttft.mean, rel=0.10)
    assert pred.ttft.p50 == pytest.approx(sim.ttft.p50, rel=0.10)
    assert pred.tpot.mean == pytest.approx(sim.tpot.mean, rel=0.05)
    assert pred.requests_per_s == pytest.approx(sim.requests_per_s, rel=0.05)


def test_prefill_first_waves_are_exact():
    # SGLang / vLLM V0: the decodes wait for the wave's prompts, every client ends in the same step, and each
    # wave is the first one again: the j-th prompt's TTFT is the prefill steps up to its own.
    cfg = ServingConfig(chunk_size=8192, scheduler="prefill-first")
    wl = Workload(3200, 800, concurrency=32, num_prompts=160)
    pred, sim = both(L8B, H100, wl, cfg)
    assert pred.ttft.mean == pytest.approx(sim.ttft.mean, rel=1e-3)
    assert pred.ttft.p99 == pytest.approx(sim.ttft.p99, rel=1e-3)
    assert pred.tpot.mean == pytest.approx(sim.tpot.mean, rel=1e-3)
    assert pred.extra["closed_loop"] == "waves"


def test_a_wave_queues_its_prompts_so_ttft_is_several_prefills():
    # The published runs the planner missed: N clients at once, fixed lengths. One prefill is not the TTFT.
    cfg = ServingConfig(chunk_size=8192, scheduler="prefill-first")
    one = predict_serving(L8B, H100, Workload(3200, 800, concurrency=1), cfg).ttft.mean
    ttfts = [predict_serving(L8B, H100, Workload(3200, 800, concurrency=n), cfg).ttft.mean for n in (4, 16, 64)]
    assert ttfts[0] > 1.5 * one and ttfts[1] > 5 * one and ttfts[2] > 15 * one
    mixed = predict_serving(L8B, H100, Workload(1024, 128, concurrency=16), ServingConfig(chunk_size=8192))
    lone = predict_serving(L8B, H100, Workload(1024, 128, concurrency=1), ServingConfig(chunk_size=8192))
    assert mixed.extra["cohorts"] == [7, 7, 2]  # a cohort is prefilled in one step: several prompts' worth
    assert mixed.ttft.p50 > 4 * lone.ttft.p50


def test_one_client_is_its_own_prefill_and_decode():
    cfg = ServingConfig(chunk_size=256, dtype="fp32")
    wl = Workload(512, 64, concurrency=1, num_prompts=5)
    pred, sim = both(SMALL, CPU, wl, cfg)
    assert pred.ttft.mean == pytest.approx(sim.ttft.mean, rel=1e-3)
    assert pred.tpot.mean == pytest.approx(sim.tpot.mean, rel=1e-3)


def test_the_first_wave_counts_only_in_a_run_of_given_length():
    cfg = ServingConfig(chunk_size=8192)
    settled = predict_serving(L8B, H100, Workload(1024, 128, concurrency=64), cfg)
    run = predict_serving(L8B, H100, Workload(1024, 128, concurrency=64, num_prompts=128), cfg)
    assert run.ttft.mean > 1.5 * settled.ttft.mean  # half the run is the wave that sent everything at once
    assert run.ttft.p99 > 3 * settled.ttft.p99


def test_spread_lengths_break_the_waves():
    cfg = ServingConfig(chunk_size=2048)
    wl = Workload(4096, 256, concurrency=32, spread=0.3)
    pred = predict_serving(L8B, H100, wl, cfg)
    sim = simulate(L8B, H100, wl, cfg, num_requests=1500, seed=1)
    assert pred.ttft.mean == pytest.approx(sim.ttft.mean, rel=0.15)
    assert pred.tpot.mean == pytest.approx(sim.tpot.mean, rel=0.05)


@pytest.mark.parametrize(("share", "burstiness"), [(0.3, 1.0), (0.6, 1.0), (0.6, 0.5), (1.5, 1.0)])
def test_a_rate_with_a_concurrency_cap_is_a_jittered_loop(share, burstiness):
    # vLLM's --request-rate R --burstiness b --max-concurrency N: gamma arrivals held back by N clients.
    cfg = ServingConfig(chunk_size=2048)
    loop = predict_serving(L8B, H100, Workload(1024, 256, concurrency=64), cfg).requests_per_s
    wl = Workload(1024, 256, concurrency=64, request_rate=share * loop, burstiness=burstiness)
    pred = predict_serving(L8B, H100, wl, cfg)
    sim = simulate(L8B, H100, wl, cfg, num_requests=2000, seed=1)
    assert pred.ttft.mean == pytest.approx(sim.ttft.mean, rel=0.20)
    assert pred.tpot.mean == pytest.approx(sim.tpot.mean, rel=0.05)
    assert pred.requests_per_s == pytest.approx(sim.requests_per_s, rel=0.05)


def test_bursts_wait_longer_than_poisson_arrivals():
    cfg = ServingConfig()
    rate = 0.6 * predict_serving(L8B, H100, Workload(1024, 256, request_rate=1.0), cfg).capacity_requests_per_s
    poisson = predict_serving(L8B, H100, Workload(1024, 256, request_rate=rate), cfg)
    bursty = predict_serving(L8B, H100, Workload(1024, 256, request_rate=rate, burstiness=0.25), cfg)
    smooth = predict_serving(L8B, H100, Workload(1024, 256, request_rate=rate, burstiness=4), cfg)
    assert smooth.ttft.mean < poisson.ttft.mean < bursty.ttft.mean


def test_the_closed_form_is_fast():
    start = time.perf_counter()
    predict_serving(L8B, H100, Workload(3200, 800, concurrency=128, num_prompts=500), ServingConfig())
    assert time.perf_counter() - start < 2.0
    assert np.isfinite(predict_serving(L8B, H100, Workload(100, 10, concurrency=512), ServingConfig()).ttft.mean)
