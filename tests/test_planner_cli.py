"""`jaxserve plan`: the default example, --json keys, profile and config.json inputs, one-line errors."""

import json

import pytest

from jaxserve.cli.main import main
from planner.hardware import CATALOG


def run(capsys, *args):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *args])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_default_plan_prints_a_report(capsys):
    code, out, err = run(capsys)
    assert code == 0, err
    assert "llama-3.1-8b" in out and "h100-sxm" in out
    assert "TTFT" in out and "bottleneck" in out and "candidates" in out


def test_json_has_the_promised_keys(capsys):
    code, out, _ = run(capsys, "--json", "--model", "llama-3.1-70b", "--num-devices", "8", "--request-rate", "2",
                       "--ttft-slo-ms", "2000", "--tpot-slo-ms", "100", "--disaggregate")
    assert code == 0
    j = json.loads(out)
    assert {"model", "hardware", "num_devices", "config", "predicted", "disaggregated", "candidates"} <= set(j)
    assert set(j["config"]) == {"tp", "replicas", "max_num_seqs", "chunk_size", "page_size", "dtype", "kv_dtype",
                                 "num_scheduler_steps", "async_scheduling", "scheduler", "moe_kernels"}
    p = j["predicted"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert set(p[key]) == {"mean", "p50", "p90", "p99"}
    assert {"output_tokens_per_s", "requests_per_s", "goodput_requests_per_s", "kv_capacity_tokens",
            "max_concurrency", "memory_gib", "step_ms", "bottleneck"} <= set(p)
    assert set(p["memory_gib"]) == {"weights", "kv", "activations", "total"}
    assert set(p["step_ms"]) == {"decode", "prefill_chunk"}
    d = j["disaggregated"]
    assert {"prefill", "decode", "kv_transfer_ms", "goodput_per_device", "colocated_goodput_per_device"} <= set(d)
    assert d["prefill"]["instances"] * d["prefill"]["tp"] + d["decode"]["instances"] * d["decode"]["tp"] <= 8
    assert j["config"]["tp"] * j["config"]["replicas"] == 8
    assert isinstance(j["candidates"], list) and j["candidates"]


def test_fixed_knobs_are_held(capsys):
    code, out, _ = run(capsys, "--json", "--num-devices", "4", "--tp", "2", "--max-num-seqs", "64",
                       "--chunk-size", "1024", "--dtype", "fp8")
    c = json.loads(out)["config"]
    assert code == 0 and (c["tp"], c["replicas"], c["max_num_seqs"], c["chunk_size"]) == (2, 2, 64, 1024)
    assert c["dtype"] == c["kv_dtype"] == "fp8"


def test_hardware_profile_and_hf_config_paths(capsys, tmp_path):
    profile = tmp_path / "gpu.json"
    profile.write_text(json.dumps({"name": "my-gpu", "base": "a100-80g", "coefficients": {"step_overhead_s": 0.001}}))
    config = tmp_path / "m"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({
        "architectures": ["MistralForCausalLM"], "hidden_size": 1024, "num_attention_heads": 16,
        "num_key_value_heads": 4, "num_hidden_layers": 8, "intermediate_size": 4096, "vocab_size": 32000}))
    code, out, err = run(capsys, "--json", "--hardware", str(profile), "--model", str(config))
    assert code == 0, err
    j = json.loads(out)
    assert j["hardware"] == "my-gpu" and j["model"] == "m"


@pytest.mark.parametrize(("args", "words"), [
    (["--model", "gpt-5"], "unknown model"),
    (["--hardware", "abacus"], "unknown hardware"),
    (["--tp", "3", "--num-devices", "3"], "does not divide"),
    (["--model", "llama-3.1-405b"], "does not fit"),
    (["--input-len", "0"], "--input-len"),
    (["--output-len", "-5"], "--output-len"),
    (["--request-rate", "1", "--concurrency", "4", "--burstiness", "-1"], "--burstiness"),
    (["--concurrency", "4", "--num-prompts", "0"], "--num-prompts"),
    (["--scheduler", "lottery"], "lottery"),
    (["--moe-kernels", "fast"], "fast"),
    (["--dtype", "fp7"], "fp7"),
    (["--model", "llama-3.1-8b", "--input-len", "10000000"], "exceed llama-3.1-8b's context of 131072 tokens"),
    (["--model", "llama-3.1-8b", "--input-len", "100000", "--output-len", "20000", "--spread", "0.5"],
     "up to 180000 with --spread 0.5"),
    (["--model", "deepseek-v3", "--num-devices", "8"], "would fit: int4 weights (--dtype int4) on these 8 devices"),
    (["--model", "llama-3.1-70b", "--num-devices", "1"],
     "would fit: fp8 weights (--quantization fp8) on this device; or 2 x h100-sxm in bf16 (--num-devices 2)"),
    (["--model", "llama-3.1-70b", "--num-devices", "1", "--quantization", "fp8", "--input-len", "120000"],
     "or requests of at most 16384 tokens (input + output) on this device"),
])
def test_bad_input_is_one_line_on_stderr_with_exit_2(capsys, args, words):
    code, out, err = run(capsys, *args)
    assert code == 2
    assert out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert words in err and "Traceback" not in err


def test_a_benchmark_run_of_clients_and_a_jittered_loop(capsys):
    # vllm bench serve --max-concurrency 16 --num-prompts 80, fixed lengths: the first wave counts, then cohorts.
    code, out, _ = run(capsys, "--json", "--max-concurrency", "16", "--num-prompts", "80", "--input-len", "1024",
                       "--output-len", "128", "--chunk-size", "8192", "--tp", "1")
    j = json.loads(out)
    assert code == 0 and j["workload"]["num_prompts"] == 80
    run_ttft = j["predicted"]["ttft_ms"]
    code, out, _ = run(capsys, "--json", "--max-concurrency", "16", "--input-len", "1024", "--output-len", "128",
                       "--chunk-size", "8192", "--tp", "1")
    assert run_ttft["p99"] > json.loads(out)["predicted"]["ttft_ms"]["p99"]  # the wave that sent all 16 at once
    # ... and with a rate: gamma arrivals held back by the clients, as vLLM's --request-rate --burstiness.
    code, out, _ = run(capsys, "--json", "--max-concurrency", "16", "--request-rate", "0.5", "--burstiness", "0.5",
                       "--scheduler", "prefill-first", "--model", "mixtral-8x7b", "--tp", "2", "--num-devices", "2",
                       "--moe-kernels", "untuned")
    j = json.loads(out)
    assert code == 0 and j["workload"]["burstiness"] == 0.5 and j["config"]["moe_kernels"] == "untuned"
    assert j["predicted"]["requests_per_s"] == pytest.approx(0.5, rel=0.01)  # under the 16 clients' 1.6 req/s


def test_unsupported_architecture_names_the_supported_ones(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    code, _, err = run(capsys, "--model", str(cfg))
    assert code == 2 and "LlamaForCausalLM" in err


def test_catalog_lists_every_required_device():
    for name in ("h100-sxm", "h200", "a100-80g", "a100-40g", "l40s", "b200", "mi300x", "tpu-v5e", "tpu-v5p", "cpu"):
        hw = CATALOG[name]
        assert {"compute", "memory", "intra_node"} <= set(hw.sources), name


def test_disaggregate_says_what_it_compares(capsys):
    from jaxserve.cli.main import main

    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama-3.1-8b", "--num-devices", "8", "--disaggregate", "--json"])
    compared = json.loads(capsys.readouterr().out)["disaggregated"]["compared"]
    assert "of the 8 devices" in compared and "colocated plan on all 8" in compared
    assert "goodput per device" in compared and "no SLOs given" in compared
