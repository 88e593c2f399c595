"""`pool_balance`: each disaggregated pool's capacity, their ratio and the P:D split, on hand-checkable numbers.

The hardware below has unbounded FLOP/s and bandwidth, so a step costs only its fixed overheads: 10 ms per
step, 1 ms per sequence, 0.1 ms per prefill token. A 100-token prompt: 10 + 1 + 10 = 21 ms (47.62 req/s);
a 4-sequence decode step: 10 + 4 = 14 ms, so 4 requests of 11 tokens (10 decode steps each) per 140 ms
(28.57 req/s).
"""

import pytest

from modelspec.spec import load_model_spec
from planner.disaggregate import PoolBalance, plan_disaggregated, pool_balance
from planner.hardware import CATALOG, Coefficients, Hardware
from planner.serving import Workload
from planner.step_model import decode_shape, prefill_shape, step_time_shape

OVERHEAD_ONLY = Hardware(
    name="overhead-only", peak_flops={"fp32": 1e30, "bf16": 1e30}, memory_bytes=1e12, memory_bw=1e30,
    intra_node_bw=1e30, allreduce_latency_s=0.0, inter_node_bw=1e30,
    coefficients=Coefficients(step_overhead_s=0.010, layer_overhead_s=0.0, seq_overhead_s=0.001,
                              prefill_token_overhead_s=0.0001))


def balance(**kw) -> PoolBalance:
    args = dict(prefill_tp=1, decode_tp=1, decode_batch=4, dtype="fp32") | kw
    return pool_balance(load_model_spec("tiny"), OVERHEAD_ONLY, 100, 11, **args)


def test_capacities_and_balance_by_hand():
    b = balance()
    assert b.prefill_s == pytest.approx(0.021)
    assert b.decode_step_s == pytest.approx(0.014)
    assert b.prefill_rps == pytest.approx(1 / 0.021)  # 47.62
    assert b.decode_rps == pytest.approx(4 / (0.014 * 10))  # 28.57
    assert b.balance == pytest.approx(0.14 / 0.084)  # 1.667: one prefill device outruns one decode device
    assert b.balanced_pd == pytest.approx(0.6)  # P:D = 3:5
    assert b.split(8) == (3, 5)  # exactly balanced: 3 x 47.62 = 5 x 28.57 = 142.86 req/s
    assert b.requests_per_s(3, 5) == pytest.approx(3 / 0.021)
    assert b.kv_bytes_per_request == 100 * 512  # tiny: 2 layers x (K, V) x 2 KV heads x 16 dims x 4 bytes


def test_fractional_batch_interpolates_and_tp_counts_devices():
    assert balance(decode_batch=4.5).decode_rps == pytest.approx(4.5 / (0.0145 * 10))
    b = balance(prefill_tp=2)  # no communication cost on this hardware: the same step time on twice the devices
    assert b.prefill_rps == pytest.approx(1 / 0.021)
    assert b.balanced_pd == pytest.approx(1.2)  # (28.57 / 1) / (47.62 / 2)
    assert b.split(8) == (2, 4)  # 4 + 4 devices: min(95.2, 114.3) = 95.2 req/s; (3, 2) gives 57.1
    assert balance().split(1) == (0, 0)
    assert balance(decode_batch=1).decode_rps == pytest.approx(1 / (0.011 * 10))
    with pytest.raises(ValueError, match="decode_batch"):
        balance(decode_batch=0.5)


def test_single_token_requests_never_reach_the_decode_pool():
    b = pool_balance(load_model_spec("tiny"), OVERHEAD_ONLY, 100, 1, dtype="fp32")
    assert b.decode_rps == float("inf") and b.balance == 0.0


def test_same_step_model_as_the_disaggregated_plan():
    spec, hw = load_model_spec("small"), CATALOG["cpu"]
    b = pool_balance(spec, hw, 128, 32, decode_batch=8, dtype="fp32")
    assert b.prefill_s == step_time_shape(spec, hw, prefill_shape(128, 0), dtype="fp32").total_s
    assert b.decode_step_s == step_time_shape(spec, hw, decode_shape(8, 128 + 16), dtype="fp32").total_s
    # plan_disaggregated's prefill pool is an M/G/1 queue with this service time: at 100 req/s on the
    # overhead-only device (two instances serve 95.2 req/s), it needs at least three prefill instances.
    plan = plan_disaggregated(load_model_spec("tiny"), OVERHEAD_ONLY, Workload(100, 11, request_rate=100.0), 8,
                              dtype="fp32")
    assert plan is not None and plan.prefill_instances * plan.prefill_tp >= 3
    assert 100.0 / plan.prefill_instances < balance(prefill_tp=plan.prefill_tp).prefill_rps
