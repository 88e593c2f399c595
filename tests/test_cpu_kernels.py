"""jaxserve's C++ CPU kernels (attention, few-row matmuls): built once per machine, used by single-device
engines, and optional.

Attention is checked against a dense reference in tests/test_paged_attention.py (decode_mode "kernel"), the
matmul against numpy in tests/test_model_linear.py, and both end to end by every engine test: `tiny` engines run
through them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import jax.numpy as jnp
import pytest
from cli_helpers import engine_config_from_flags

from jaxserve import LLM
from jaxserve.core.batch import trash_prefill
from jaxserve.kernels.cpu import attention as cpu_attention
from jaxserve.kernels.cpu import library as cpu_kernels
from jaxserve.kernels.cpu import matmul as cpu_matmul
from jaxserve.kernels.cpu.kernel_plan import KernelPlan
from jaxserve.platform import kernel_choice
from jaxserve.runner.sampler import SamplingArrays
from tests.conftest import TINY_ENGINE_ARGS


def forward_hlo(llm: LLM, num_tokens: int = 8) -> str:
    runner = llm.engine.runner
    batch = trash_prefill(num_tokens, runner.page_size, runner.max_num_seqs, runner.pages_per_seq * runner.page_size)
    return runner.lower_forward(batch, num_tokens).as_text()


def planned_llm(matmul_rows: range | set[int], head_rows: range | set[int]) -> LLM:
    """A `tiny` engine given this plan rather than the one measured on this machine."""
    plan = KernelPlan(cpu_kernels.isa() or "", frozenset(matmul_rows), frozenset(head_rows))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel_choice, "choose", lambda *args, **kwargs: plan)
        return LLM(model="tiny", **TINY_ENGINE_ARGS)


@pytest.fixture(scope="module")
def every_row_llm() -> LLM:
    """Every row count the matmul kernel takes goes to it."""
    every = range(1, cpu_matmul.MAX_ROWS + 1)
    return planned_llm(every, every)


def test_a_built_library_is_reused(tmp_path, monkeypatch):
    compiles = []

    def fake_run(cmd, **kwargs):  # a compiler that writes its output at once: the cache logic, not g++, is tested
        if "--version" in cmd:
            return subprocess.CompletedProcess(cmd, 0, stdout="fake c++ 1.0\n", stderr="")
        compiles.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"library")
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(cpu_kernels.subprocess, "run", fake_run)
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: "c++")
    first = cpu_kernels.build(tmp_path)
    built = len(compiles)
    assert built == len(cpu_kernels.SOURCES) + 1  # each source into an object, then one link
    stamp = os.stat(first).st_mtime_ns
    assert cpu_kernels.build(tmp_path) == first and os.stat(first).st_mtime_ns == stamp
    assert len(compiles) == built  # the second call found the library and ran no compiler
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left behind


def test_single_device_engines_run_in_the_kernels(every_row_llm):
    few_rows = forward_hlo(every_row_llm, num_tokens=8)
    assert cpu_attention.TARGET in few_rows and cpu_matmul.TARGET in few_rows
    # Wider steps keep XLA's GEMMs, which catch up with the matmul kernel from ~64 rows.
    wide = forward_hlo(every_row_llm, num_tokens=64)
    assert cpu_attention.TARGET in wide and cpu_matmul.TARGET not in wide


def test_the_engine_runs_the_matmul_kernel_at_its_plans_row_counts_only():
    llm = planned_llm({8}, set())
    assert cpu_matmul.TARGET in forward_hlo(llm, num_tokens=8)
    assert cpu_matmul.TARGET not in forward_hlo(llm, num_tokens=4)


def test_the_engine_measures_its_plan_at_start_up(tiny_llm):
    plan = tiny_llm.engine.runner.ops.matmul.plan
    assert plan is not None and plan.isa == cpu_kernels.isa()
    assert plan.matmul_rows <= set(tiny_llm.engine.runner.token_buckets)


def test_a_tied_lm_head_reads_the_embedding_through_the_kernel(every_row_llm):
    runner = every_row_llm.engine.runner
    rows = jnp.ones((runner.max_sampled, every_row_llm.engine.spec.hidden_size), jnp.float32)
    hlo = runner.sampler.lower(rows, SamplingArrays.build([], 4)).as_text()
    assert cpu_matmul.TARGET_NT in hlo


def test_the_kernels_can_be_turned_off():
    llm = LLM(model="tiny", **TINY_ENGINE_ARGS, cpu_kernels=False)
    hlo = forward_hlo(llm)
    assert cpu_attention.TARGET not in hlo and cpu_matmul.TARGET not in hlo


def test_without_a_compiler_the_model_stays_in_xla(monkeypatch, caplog, tmp_path):
    def no_compiler() -> str:
        raise FileNotFoundError("no C++ compiler (c++, g++ or clang++) on PATH")

    monkeypatch.setattr(cpu_kernels, "_compiler", no_compiler)
    assert not cpu_kernels.load(tmp_path)
    assert "CPU kernels are unavailable (no C++ compiler" in caplog.text
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    llm = LLM(model="tiny", **TINY_ENGINE_ARGS)
    hlo = forward_hlo(llm)
    assert cpu_attention.TARGET not in hlo and cpu_matmul.TARGET not in hlo


def test_a_compile_error_is_reported_by_its_first_error_line():
    stderr = "x.cc:3:5: error: 'foo' was not declared in this scope\n    3 |   foo();\n      |   ^~~"
    assert cpu_kernels._first_error(stderr) == "x.cc:3:5: error: 'foo' was not declared in this scope"


@pytest.mark.parametrize(("argv", "expected"), [([], True), (["--no-cpu-kernels"], False)])
def test_the_cli_flag_reaches_the_engine_config(argv, expected):
    config, output = engine_config_from_flags(*argv)
    assert config is not None, output
    assert config.cpu_kernels is expected
