"""The C++ CPU attention kernel: built once per machine, used by single-device engines, and optional.

Its numbers are checked against a dense reference in tests/test_paged_attention.py (decode_mode "kernel") and,
end to end, by every engine test: `tiny` engines attend through it.
"""

from __future__ import annotations

import os

import click
import pytest
from click.testing import CliRunner

from jaxserve import LLM
from jaxserve.engine_args import config_from_options, engine_options
from jaxserve.model import cpu_attention
from jaxserve.model_runner import _trash_prefill
from tests.conftest import TINY_ENGINE_ARGS


def forward_hlo(llm: LLM, num_tokens: int = 8) -> str:
    runner = llm.engine.runner
    batch = _trash_prefill(num_tokens, runner.page_size, runner.max_num_seqs, runner.pages_per_seq * runner.page_size)
    return runner._forward_for(num_tokens).lower(runner.param_leaves, runner.kv_caches,
                                                 runner._device_inputs(batch, num_tokens), runner._no_prev).as_text()


def test_a_built_kernel_is_reused(tmp_path):
    first = cpu_attention.build(tmp_path)
    stamp = os.stat(first).st_mtime_ns
    assert cpu_attention.build(tmp_path) == first and os.stat(first).st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left behind


def test_single_device_engines_attend_in_the_kernel(tiny_llm):
    assert cpu_attention.TARGET in forward_hlo(tiny_llm)


def test_the_kernel_can_be_turned_off():
    llm = LLM(model="tiny", **TINY_ENGINE_ARGS, warmup=False, cpu_attention_kernel=False)
    assert cpu_attention.TARGET not in forward_hlo(llm)


def test_without_a_compiler_attention_stays_in_jnp(monkeypatch, caplog, tmp_path):
    def no_compiler() -> str:
        raise FileNotFoundError("no C++ compiler (c++, g++ or clang++) on PATH")

    monkeypatch.setattr(cpu_attention, "_compiler", no_compiler)
    assert not cpu_attention.load(tmp_path)
    assert "CPU attention kernel unavailable (no C++ compiler" in caplog.text
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    llm = LLM(model="tiny", **TINY_ENGINE_ARGS, warmup=False)
    assert cpu_attention.TARGET not in forward_hlo(llm)


@pytest.mark.parametrize(("argv", "expected"), [([], True), (["--no-cpu-attention-kernel"], False)])
def test_the_cli_flag_reaches_the_engine_config(argv, expected):
    seen = []

    @click.command()
    @engine_options
    def command(**options):
        seen.append(config_from_options(options))

    result = CliRunner().invoke(command, argv)
    assert result.exit_code == 0, result.output
    assert seen[0].cpu_attention_kernel is expected
