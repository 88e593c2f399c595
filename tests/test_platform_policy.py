"""The platform policy: every device-dependent choice made once at start-up, from the platform alone (given the
attention backend), and what the engine does with it."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import pytest

from jaxserve import LLM
from jaxserve.kernels.gpu.ragged_paged_attention import PallasAttention
from jaxserve.kernels.gpu.split_kv_decode import SplitKvAttention
from jaxserve.model.attention.reference import ACCELERATOR_TUNING, CPU_TUNING
from jaxserve.model.ops import XLA_MATMULS
from jaxserve.platform.attention_choice import select_backend
from jaxserve.platform.devices import device_facts, host_memory_bytes
from jaxserve.platform.kernel_choice import CPU_XLA_ROUTE
from jaxserve.platform.policy import default_dtype, policy_for
from tests.conftest import TINY_ENGINE_ARGS


def test_a_cpu_searches_its_cut_runs_wide_steps_alone_and_keeps_the_synchronous_loop():
    cpu = policy_for("cpu", CPU_TUNING)
    assert cpu.sampler_cut == "search" and cpu.ops.matmul == CPU_XLA_ROUTE
    assert cpu.overlaps(8) and not cpu.overlaps(9)
    assert not cpu.async_by_default and cpu.token_buckets((1, 2, 4, 16)) == (1, 2, 4, 16)
    assert cpu.compiler_options(2048) is None and cpu.compiler_options(4096)  # separate dots on the widest
    assert default_dtype("cpu") == jnp.float32
    assert cpu.decode_run_exits_early  # a k-step run ends when its sequences have
    assert cpu.pools_as_pinned_processes  # a disaggregated report's pools: servers on their own cores


@pytest.mark.parametrize("platform", ["gpu", "cuda", "rocm"])
def test_a_gpu_sorts_overlaps_every_step_and_pads_steps_to_eight_rows(platform):
    gpu = policy_for(platform, ACCELERATOR_TUNING)
    assert gpu.sampler_cut == "sort" and gpu.ops.matmul == XLA_MATMULS and not gpu.ops.matmul.moe_tiles_in_use
    assert gpu.overlaps(10**6) and gpu.async_by_default
    assert gpu.token_buckets((1, 2, 4, 8, 16, 64)) == (8, 16, 64)
    assert gpu.compiler_options(10**6) is None and default_dtype(platform) == jnp.bfloat16
    assert not gpu.decode_run_exits_early  # a static trip count: no loop condition read back each iteration
    assert not gpu.pools_as_pinned_processes  # each pool on its own devices, in one process


def test_the_engine_takes_its_loop_and_buckets_from_the_policy(tiny_llm: LLM):
    engine = tiny_llm.engine
    assert engine.policy.platform == "cpu" and engine.loop.name == "synchronous"
    assert engine.config.async_scheduling is False  # unset: the CPU's default, resolved at start-up
    assert engine.runner.policy is engine.policy and engine.runner.ops is engine.policy.ops
    assert engine.policy.facts == device_facts()  # read once at start-up; the measurement tools read them here


def test_an_explicit_loop_wins_over_the_platforms_default():
    llm = LLM(model="tiny", async_scheduling=True, **TINY_ENGINE_ARGS)
    assert llm.engine.loop.name == "overlapped"


def test_a_gpu_splits_decodes_over_the_kv_and_runs_a_step_of_decodes_alone():
    split = SplitKvAttention(num_sms=132)
    gpu = policy_for("gpu", split)
    assert gpu.ops.attention == split and gpu.ops_for(True).attention == dataclasses.replace(split, decode_only=True)
    assert gpu.ops_for(False) is gpu.ops
    assert policy_for("gpu", ACCELERATOR_TUNING).ops_for(True) == policy_for("gpu", ACCELERATOR_TUNING).ops


def test_auto_on_a_gpu_is_the_split_kv_kernel_sized_to_the_device():
    backend = select_backend("auto", "gpu", jnp.bfloat16, 64, 16, num_sms=108)
    assert isinstance(backend, SplitKvAttention) and backend.num_sms == 108
    assert select_backend("pallas", "gpu", jnp.bfloat16, 64, 16, num_devices=2) == PallasAttention()  # sharded later


def test_device_facts_describe_this_processs_cpu_once():
    facts = device_facts()
    assert (facts.platform, facts.cpu) == ("cpu", True)
    assert facts.memory_bytes == host_memory_bytes() > 0  # a CPU's memory is the host's
    assert facts == device_facts(jax.devices()[:1])
    assert facts.cores == tuple(sorted(os.sched_getaffinity(0)))  # the cores pinned pools are given, read here once
