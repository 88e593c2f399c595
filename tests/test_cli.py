"""The runtime's command line: generate streams text, convert makes a faster-loading copy that serves the
same tokens, and bad input is one line on stderr with exit code 2."""

import subprocess
import sys

import pytest
from cli_helpers import engine_config_from_flags, run_cli
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.model.checkpoint import save_hf_checkpoint
from jaxserve.model.llama import LlamaForCausalLM
from modelspec.spec import PRESETS
from tests.conftest import TINY_ENGINE_ARGS


def jaxserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve", *args], capture_output=True, text=True, timeout=300)


def test_generate_streams_text_and_reports_timing():
    r = jaxserve("generate", "--model", "tiny", "--prompt", "Hello", "--max-tokens", "6", "--ignore-eos",
                 "--max-num-batched-tokens", "64", "--max-num-seqs", "4", "--kv-cache-memory", "4MiB")
    assert r.returncode == 0, r.stderr
    assert "[6 tokens, finish_reason=length, TTFT" in r.stderr
    overlapped = jaxserve("generate", "--model", "tiny", "--prompt", "Hello", "--max-tokens", "6", "--ignore-eos",
                          "--max-num-batched-tokens", "64", "--max-num-seqs", "4", "--kv-cache-memory", "4MiB",
                          "--temperature", "0", "--async-scheduling", "--no-warmup")  # the first run warmed up
    assert overlapped.returncode == 0, overlapped.stderr
    assert "[6 tokens, finish_reason=length, TTFT" in overlapped.stderr
    assert overlapped.stdout == r.stdout  # greedy: the same text with and without overlap


def test_a_bad_flag_is_one_line_and_exit_2_from_the_real_process():
    r = jaxserve("generate", "--model", "no-such-model", "--prompt", "x")
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:"), r.stderr


def test_bad_flags_are_one_line_and_exit_2():
    for args in (["generate", "--prompt", "x", "--kv-cache-memory", "lots"],
                 ["generate", "--prompt", "x", "--chunk-size", "17"],
                 ["generate", "--prompt", "x", "--async-scheduling", "--disaggregate"],
                 ["calibrate", "--async-scheduling"],
                 ["convert", "/no/such/folder", "/tmp/out"],
                 # outputs that cannot be written fail before minutes of measuring, not after
                 ["calibrate", "--out", "/proc/no/such/profile.json"],
                 ["convert", "tests", "/proc/no/such/converted"],
                 ["report", "--quick", "--out", "/proc/no/such"],
                 ["bench", "latency", "--output-json", "/proc/no/such/lat.json"],
                 ["bench", "serve", "--save-result", "/proc/no/such/serve.json"]):
        code, err = run_cli(*args)
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("error:"), err


@pytest.mark.parametrize(("argv", "expected"), [([], EngineConfig.compilation_cache_dir),
                                                (["--compilation-cache-dir", "none"], None),
                                                (["--compilation-cache-dir", "/tmp/xla"], "/tmp/xla")])
def test_the_compilation_cache_folder_is_a_flag(argv, expected):
    config, output = engine_config_from_flags(*argv)
    assert config is not None, output
    assert config.compilation_cache_dir == expected


@pytest.mark.parametrize(("argv", "expected"), [([], True), (["--no-warmup"], False), (["--warmup"], True)])
def test_warming_up_is_a_flag(argv, expected):
    config, output = engine_config_from_flags(*argv)
    assert config is not None, output
    assert config.warmup is expected


def test_converted_checkpoint_serves_the_same_tokens(tmp_path):
    spec = PRESETS["tiny"]
    hf = save_hf_checkpoint(LlamaForCausalLM(spec, "float32", rngs=nnx.Rngs(3)), spec, tmp_path / "hf")
    r = jaxserve("convert", str(hf), str(tmp_path / "converted"))
    assert r.returncode == 0, r.stderr
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 9]]
    from_hf = LLM(model=str(hf), **TINY_ENGINE_ARGS).generate(prompt, greedy)[0].token_ids
    from_converted = LLM(model=str(tmp_path / "converted"), **TINY_ENGINE_ARGS).generate(prompt, greedy)[0].token_ids
    assert from_hf == from_converted and len(from_hf) == 8
