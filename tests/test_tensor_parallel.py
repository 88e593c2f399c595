"""Tensor parallelism on 8 fake CPU devices (in a subprocess): TP 1, 2 and 4 give the same greedy tokens.

`tiny` has 4 query heads and 2 KV heads, so TP 4 replicates each KV head twice at load time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve.runner.parallel import check_tp, effective_spec
from modelspec.memory import kv_heads_per_device, kv_pool_pages
from modelspec.spec import load_model_spec

DRIVER = Path(__file__).with_name("multidevice_driver.py")


def run_driver(*args: str, timeout: float = 300) -> dict:
    proc = subprocess.run([sys.executable, str(DRIVER), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tp_runs() -> dict:
    return run_driver("tp", "1", "2", "4")


def test_same_greedy_tokens_for_tp_1_2_4(tp_runs):
    ref = tp_runs["1"]["tokens"]
    assert all(len(t) == 10 for t in ref)
    for tp in ("2", "4"):
        assert tp_runs[tp]["tokens"] == ref, f"TP {tp} differs from TP 1"


def test_logprobs_within_float32_tolerance(tp_runs):
    ref = tp_runs["1"]["logprobs"]
    for tp in ("2", "4"):
        for a, b in zip(ref, tp_runs[tp]["logprobs"], strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)


def test_no_compile_after_warmup(tp_runs):
    for tp, run in tp_runs.items():
        assert run["compiles_after_warmup"] == 0, f"TP {tp} compiled after warm-up"


def test_kv_pages_sharded_on_kv_heads_with_replication(tp_runs):
    spec = load_model_spec("tiny")
    for tp in (1, 2, 4):
        run = tp_runs[str(tp)]
        assert run["kv_devices"] == tp
        assert run["kv_shape"][2] == max(spec.num_kv_heads, tp)  # replicated up to one KV head per device
        assert run["kv_shard_shape"][2] == kv_heads_per_device(spec, tp)
        # The pool holds what the planner predicts for this per-device budget at this TP degree.
        assert run["num_pages"] == kv_pool_pages(spec, 2 * 2**20, 16, "fp32", tp)


@pytest.mark.parametrize("backend", ["pallas", "pallas-split"])
def test_the_pallas_kernels_under_shard_map_give_tp_1s_tokens(backend):
    """Each device attends with its own heads (model/attention/sharded.py); interpreted on a CPU, so short."""
    runs = run_driver("tp-pallas", backend, "1", "2", timeout=900)
    assert runs["1"]["tokens"] == runs["2"]["tokens"]
    assert runs["2"]["attention"] == "ShardedAttention" and runs["1"]["attention"] != "ShardedAttention"
    assert runs["2"]["compiles_after_warmup"] == 0


def test_checkpoint_with_qkv_bias_and_untied_head():
    """Loading straight onto the mesh (TP 2) and re-laying qkv and its bias for replicated KV heads (TP 4)."""
    runs = run_driver("tp-checkpoint", "1", "2", "4")
    assert runs["2"] == runs["1"] and runs["4"] == runs["1"]


def test_batched_decode_attention_under_tp():
    """The GPU decode path (decode_mode="batched", forced here on CPU) shards the same way."""
    runs = run_driver("tp-batched-decode", "1", "4")
    assert runs["4"]["tokens"] == runs["1"]["tokens"]
    assert runs["4"]["compiles_after_warmup"] == 0


def test_async_scheduling_under_tp(tp_runs):
    """Placeholder tokens read from the previous step's sharded-mesh output: same tokens, no compile."""
    runs = run_driver("tp-async", "2")
    assert runs["2"]["tokens"] == tp_runs["1"]["tokens"]
    assert runs["2"]["compiles_after_warmup"] == 0


def test_effective_spec_and_checks():
    spec = load_model_spec("tiny")  # 4 heads, 2 KV heads
    assert effective_spec(spec, 2) is spec
    assert effective_spec(spec, 4).num_kv_heads == 4
    with pytest.raises(ValueError, match="divide the number of attention heads"):
        check_tp(spec, 8)
    with pytest.raises(ValueError, match="divide the number of attention heads"):
        check_tp(spec, 3)
