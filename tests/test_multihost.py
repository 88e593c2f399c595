"""Two processes on localhost with `jax.distributed` on CPU (TP 2 across them) give the same tokens as one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve.core.batch import RaggedBatch
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.runner.distributed import pack, unpack
from jaxserve.runner.sampler import SamplingArrays

DRIVER = Path(__file__).with_name("multihost_driver.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices_per_process: int = 1) -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if devices_per_process > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_process}"
    return env


def _two_processes(tp: int, devices_per_process: int) -> dict:
    cmd = [sys.executable, str(DRIVER), str(_free_port()), "2"]
    env = _env(devices_per_process)
    follower = subprocess.Popen([*cmd, "1", str(tp)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
    leader = subprocess.run([*cmd, "0", str(tp)], capture_output=True, text=True, timeout=300, env=env)
    _, err_f = follower.communicate(timeout=120)
    assert leader.returncode == 0, leader.stderr[-3000:]
    assert follower.returncode == 0, err_f[-3000:]  # followers exit cleanly once process 0 stops
    return json.loads(leader.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def one_process() -> dict:
    alone = subprocess.run([sys.executable, str(DRIVER), "0", "1", "0"], capture_output=True, text=True,
                           timeout=300, env=_env())
    assert alone.returncode == 0, alone.stderr[-3000:]
    return json.loads(alone.stdout.strip().splitlines()[-1])


def test_two_processes_same_tokens_as_one(one_process):
    two = _two_processes(tp=2, devices_per_process=1)
    assert two["devices"] == 2 and one_process["devices"] == 1
    assert two["tokens"] == one_process["tokens"]


@pytest.mark.slow
def test_two_processes_of_two_devices_tp4_with_kv_replication(one_process):
    four = _two_processes(tp=4, devices_per_process=2)
    assert four["devices"] == 4
    assert four["tokens"] == one_process["tokens"]


def test_step_message_round_trip():
    rng = np.random.default_rng(0)
    t, s, pages = 11, 3, 4
    batch = RaggedBatch(requests=[None] * s, num_decodes=1, token_ids=rng.integers(0, 500, t, dtype=np.int32),
                        positions=np.arange(t, dtype=np.int32), cu_q_lens=np.array([0, 1, 5, 11], np.int32),
                        kv_lens=np.array([9, 4, 6], np.int32),
                        page_table=rng.integers(0, 50, (s, pages), dtype=np.int32),
                        slot_mapping=rng.integers(0, 800, t, dtype=np.int32),
                        logits_indices=np.array([0, 4, 10], np.int32), samples=np.array([True, False, True]))
    rows = [(SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, logprobs=2), 2**32 - 5, 3),
            (SamplingParams(), 7, 0)]
    sampling = SamplingArrays.build(rows, 4)
    buf = pack(batch, sampling)
    assert buf.dtype == np.int32 and len(buf) & (len(buf) - 1) == 0
    got_batch, got_sampling = unpack(buf)
    assert got_batch.num_seqs == s and got_batch.num_decodes == 1
    for name in ("token_ids", "positions", "cu_q_lens", "kv_lens", "page_table", "slot_mapping", "logits_indices",
                 "samples"):
        np.testing.assert_array_equal(getattr(got_batch, name), getattr(batch, name), err_msg=name)
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "step"):
        a, b = getattr(got_sampling, name), getattr(sampling, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert got_sampling.want_logprobs
