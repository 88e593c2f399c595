"""The `jaxserve bench` commands end to end (each builds its own tiny engine: slow on a cold XLA cache)."""

import json

import pytest
from click.testing import CliRunner

from jaxserve.cli.main import cli

ENGINE = ["--model", "tiny", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--chunk-size", "64",
          "--kv-cache-memory", "8MiB", "--max-model-len", "512"]


@pytest.mark.slow
def test_bench_serve_writes_vllm_json(tmp_path):
    out = tmp_path / "serve.json"
    res = CliRunner().invoke(cli, ["bench", "serve", *ENGINE, "--num-prompts", "5", "--input-len", "24",
                                   "--output-len", "4", "--request-rate", "50", "--goodput", "ttft:5000",
                                   "--save-result", str(out)])
    assert res.exit_code == 0, res.output
    assert "Serving Benchmark Result" in res.output
    data = json.loads(out.read_text())
    assert data["completed"] == 5 and data["failed"] == 0 and data["request_goodput"] is not None
    assert data["output_lens"] == [4] * 5 and len(data["itls"]) == 5


@pytest.mark.slow
def test_bench_latency_grid(tmp_path):
    out = tmp_path / "lat.json"
    res = CliRunner().invoke(cli, ["bench", "latency", *ENGINE, "--batch-sizes", "1,2", "--input-lens", "16",
                                   "--output-len", "3", "--output-json", str(out)])
    assert res.exit_code == 0, res.output
    points = json.loads(out.read_text())["points"]
    assert [(p["batch_size"], p["input_len"]) for p in points] == [(1, 16), (2, 16)]
    assert all(p["tpot_ms"] > 0 and p["ttft_ms"] > 0 for p in points)


def test_bench_rejects_bad_flags():
    res = CliRunner().invoke(cli, ["bench", "serve", "--request-rate", "0"])
    assert res.exit_code != 0
    res = CliRunner().invoke(cli, ["bench", "latency", "--batch-sizes", "a,b"])
    assert res.exit_code != 0
    res = CliRunner().invoke(cli, ["bench", "serve", "--top-p", "1.5"])
    assert res.exit_code == 2 and "top_p must be in (0, 1]" in res.output and "Traceback" not in res.output


@pytest.mark.slow
def test_requests_past_the_context_are_reported_not_lost():
    res = CliRunner().invoke(cli, ["bench", "serve", *ENGINE, "--num-prompts", "2", "--input-len", "600",
                                   "--output-len", "4", "--request-rate", "inf"])
    assert res.exit_code != 0, res.output  # every request failed: an error, named (some failing: counted, exit 0)
    assert "2 of 2 requests failed: This model's maximum context length is 512 tokens" in res.output
    res = CliRunner().invoke(cli, ["bench", "latency", *ENGINE, "--batch-sizes", "1", "--input-lens", "600"])
    assert res.exit_code == 2 and "exceed the model's max_model_len 512" in res.output, res.output
