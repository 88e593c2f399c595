"""Disaggregated prefill/decode on 8 fake CPU devices (in a subprocess).

Same greedy tokens as colocated for 1+1, 2+2 (TP 2 in each pool) and mixed pools that replicate KV heads on one
side only (1+4, 4+1); prefix caching on the prefill side; KV bytes per request equal to the planner's; no page
leaks in either pool after a random workload with aborts.
"""

from __future__ import annotations

import pytest

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.pool_stats import PoolStep, overlap_fractions
from modelspec.memory import kv_bytes_per_token
from modelspec.spec import load_model_spec
from tests.test_tensor_parallel import run_driver

PAIRS = ("1+1", "2+2", "1+4", "4+1")


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_driver("disagg", *PAIRS)


@pytest.mark.parametrize("pair", PAIRS)
def test_same_tokens_as_colocated(runs, pair):
    assert runs[pair]["tokens"] == runs["colocated"]


@pytest.mark.parametrize("pair", PAIRS)
def test_kv_bytes_moved_equal_planner_prediction(runs, pair):
    spec = load_model_spec("tiny")
    run = runs[pair]
    assert len(run["transfers"]) == len(run["tokens"])  # every request moved once (none ended on token one)
    per_token = kv_bytes_per_token(spec, "fp32", tp=1)  # all layers, the model's own KV heads
    for rid, tokens, num_bytes, block_bytes in run["transfers"]:
        assert tokens == run["prompt_lens"][rid]
        assert num_bytes == tokens * per_token
        assert block_bytes % (16 * per_token) == 0  # whole pages of unique heads: no replicas shipped
    assert run["stats"]["kv_transfer_bytes"] == sum(t[2] for t in run["transfers"])


@pytest.mark.parametrize("pair", PAIRS)
def test_pool_busy_time_and_work_are_counted(runs, pair):
    run, n = runs[pair], len(runs[pair]["tokens"])
    s = run["stats"]
    out = sum(len(t) for t in run["tokens"])
    assert s["prefill_prompts"] == n == s["kv_transfers"]  # every prompt prefilled once, on the prefill pool
    assert s["prefill_prompt_tokens"] == sum(run["prompt_lens"].values()) - s["prefix_cache_hits"]
    assert s["prefill_steps"] >= 2  # two generate calls
    assert s["decode_output_tokens"] == out - n  # the first token of each request comes from the prefill pool
    assert s["generation_tokens"] == out
    assert s["decode_steps"] == s["steps"] >= max(len(t) for t in run["tokens"]) - 1
    assert s["decode_batch_seqs"] == s["decode_output_tokens"]  # no decode-side recompute: one token per sequence
    assert 1 <= s["decode_mean_batch"] <= 8  # max_num_seqs
    for pool in ("prefill", "decode"):  # busy time is real and within the run's wall time
        assert 0 < s[f"{pool}_busy_seconds"] <= run["seconds"]
    assert s["prefill_prompts_per_busy_s"] == pytest.approx(n / s["prefill_busy_seconds"])
    steps = {pool: [PoolStep(*x[:4], tuple(map(tuple, x[4]))) for x in run["pool_steps"][pool]]
             for pool in ("prefill", "decode")}
    for pool, spans in steps.items():  # one record per step, in order, adding up to the busy time
        assert len(spans) == s[f"{pool}_steps"]
        assert all(a.start < a.end <= b.start for a, b in zip(spans, spans[1:], strict=False))
        assert sum(x.end - x.start for x in spans) == pytest.approx(s[f"{pool}_busy_seconds"])
    assert sum(q for x in steps["prefill"] for q, _ in x.prefill_chunks) == s["prefill_prompt_tokens"]
    assert all(x.num_decodes == 0 for x in steps["prefill"])
    assert sum(x.num_decodes for x in steps["decode"]) == s["decode_output_tokens"]
    fractions = overlap_fractions(steps["prefill"], steps["decode"])
    assert all(0 <= f <= 1 for f in fractions)
    both = sum(f * (x.end - x.start) for f, x in zip(fractions, steps["prefill"], strict=True))
    assert both <= min(s["prefill_busy_seconds"], s["decode_busy_seconds"]) + 1e-9
    assert s["decode_step_ms"] == pytest.approx(1e3 * s["decode_busy_seconds"] / s["decode_steps"])


def test_overlap_fractions_by_hand():
    def span(a: float, b: float) -> PoolStep:
        return PoolStep(a, b, 0, 0, ())

    prefill = [span(0, 2), span(3, 5), span(6, 7)]
    decode = [span(1, 4), span(4.5, 4.75), span(8, 9)]
    assert overlap_fractions(prefill, decode) == pytest.approx([0.5, 0.625, 0.0])
    assert overlap_fractions(decode, prefill) == pytest.approx([2 / 3, 1.0, 0.0])


def test_prefix_cache_hits_on_prefill_side(runs):
    for pair in PAIRS:
        assert runs[pair]["cached_tokens"] == 32
        assert runs[pair]["stats"]["prefix_cache_hits"] >= 32


def test_no_compile_after_warmup_and_ttft_includes_transfer(runs):
    for pair in PAIRS:
        assert runs[pair]["compiles_after_warmup"] == 0
        assert runs[pair]["ttft_after_transfer"]


def test_no_page_leaks_after_random_workload_with_aborts():
    r = run_driver("disagg-aborts", "0")
    assert r["finished"] > 0 and r["aborted"] > 0 and r["transfers"] > 0
    assert r["prefill_used"] == 0 and r["prefill_free"] == r["prefill_usable"]  # cached pages count as free
    assert r["decode_used"] == 0 and r["decode_free"] == r["decode_usable"]  # no prefix cache on decode
    assert r["max_pending"] <= 2 + 8  # max_pending_transfers + one prefill step's worth (max_num_seqs)


def test_config_checks():
    with pytest.raises(ValueError, match="decode_devices"):
        EngineConfig(disaggregate=True, decode_devices=0)
    with pytest.raises(ValueError, match="device_ids"):
        EngineConfig(tensor_parallel_size=2, device_ids=(0,))
    with pytest.raises(ValueError, match="coordinator_address"):
        EngineConfig(num_processes=2)
    with pytest.raises(ValueError, match="cannot be combined"):
        EngineConfig(num_processes=2, coordinator_address="localhost:1", disaggregate=True)


def test_too_few_devices_is_a_clear_error():
    from jaxserve.engine.factory import create_engine

    with pytest.raises(ValueError, match="needs 2 devices"):
        create_engine(EngineConfig(disaggregate=True, warmup=False))
    with pytest.raises(ValueError, match="visible"):
        create_engine(EngineConfig(tensor_parallel_size=2, warmup=False, kv_cache_memory=2**20))
