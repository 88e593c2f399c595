"""`jaxserve plan` takes vLLM's `--quantization` and `--kv-cache-dtype`: the same plan as the planner's own `--dtype`
and `--kv-dtype`, with fewer weight and KV bytes than 16-bit; disagreeing spellings are refused in one line."""

import json

import pytest

from jaxserve.cli.main import main


def plan(capsys, *args):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--json", "--model", "llama-3.1-8b", "--tp", "1", "--max-num-seqs", "64", *args])
    out, err = capsys.readouterr()
    return exc.value.code, json.loads(out) if exc.value.code == 0 else err


def test_vllm_names_price_the_same_as_the_planner_names(capsys):
    code, vllm = plan(capsys, "--quantization", "int8", "--kv-cache-dtype", "fp8")
    assert code == 0
    _, own = plan(capsys, "--dtype", "int8", "--kv-dtype", "fp8")
    assert vllm["config"]["dtype"] == "int8" and vllm["config"]["kv_dtype"] == "fp8"
    assert vllm["predicted"] == own["predicted"]


def test_int8_weights_and_fp8_kv_halve_weights_and_double_capacity_against_bf16(capsys):
    _, bf16 = plan(capsys)
    _, quant = plan(capsys, "--quantization", "int8", "--kv-cache-dtype", "fp8")
    mem_b, mem_q = bf16["predicted"]["memory_gib"], quant["predicted"]["memory_gib"]
    assert mem_q["weights"] == pytest.approx(mem_b["weights"] / 2, rel=0.05)  # the embedding and head shrink too
    # A token takes half its bf16 bytes plus its scales (4 bytes per KV head, against 128-wide heads), and more KV
    # bytes are left besides (the weights freed some).
    per_token_b = mem_b["kv"] / bf16["predicted"]["kv_capacity_tokens"]
    per_token_q = mem_q["kv"] / quant["predicted"]["kv_capacity_tokens"]
    assert per_token_q == pytest.approx(per_token_b / 2 * (128 + 4) / 128, rel=1e-6)
    assert quant["predicted"]["kv_capacity_tokens"] > 2 * bf16["predicted"]["kv_capacity_tokens"]


def test_disagreeing_kv_names_are_one_line_and_exit_2(capsys):
    code, err = plan(capsys, "--kv-dtype", "int8", "--kv-cache-dtype", "fp8")
    assert code == 2 and "disagree" in err and "Traceback" not in err
    code, err = plan(capsys, "--quantization", "int4")
    assert code == 2 and "int4" in err
