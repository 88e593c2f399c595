"""`jaxserve report --quantization int8 --kv-cache-dtype int8`: calibrate and every part run on int8 weights and
KV pages, and the planner prices them so: one byte a weight, read at the rate calibrate measured through the
engine's own int8 matmul (`weight_bw_eff`), and int8 KV; a profile of other dtypes is refused."""

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.measure.report.run import check_profile_dtypes
from modelspec.spec import load_model_spec
from planner.hardware import load_hardware
from planner.step_model import decode_shape, step_time_shape


def jaxserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report-int8")
    res = jaxserve("report", "--quick", "--model", "tiny", "--quantization", "int8", "--kv-cache-dtype", "int8",
                   "--out", str(out))
    assert res.returncode == 0, res.stderr
    return out


def test_the_report_calibrates_and_prices_int8_weights(report_dir):
    rep = json.loads((report_dir / "report.json").read_text())
    assert rep["dtype"] == "int8" and rep["kv_dtype"] == "int8"  # the weights' and the KV pool's codes
    assert rep["config"]["quantization"] == "int8" and rep["config"]["kv_cache_dtype"] == "int8"
    m = json.loads((report_dir / "profile.json").read_text())["measurements"]
    assert m["dtype"] == "int8" and m["kv_dtype"] == "int8" and m["compute_dtype"] == "fp32"
    # The weight term's rate is the codes' through the engine's int8 matmul, two rows (calibrate's weight stream).
    stream = m["weight_stream_2_rows_gbps"] / m["memory_bandwidth_gbps"]
    assert m["fixed_coefficients"]["weight_bw_eff"] == pytest.approx(np.clip(stream, 0.01, 1.5))
    hw, spec = load_hardware(str(report_dir / "profile.json")), load_model_spec("tiny")
    assert hw.coefficients.weight_bw_eff == pytest.approx(m["fixed_coefficients"]["weight_bw_eff"])
    grid = [r for r in rep["rows"] if r["kind"] == "grid"]
    assert len(grid) == 4
    for r in grid:  # each predicted decode step is the step model's at int8 weights, not at float32 ones
        c = r["config"]
        shape = decode_shape(c["batch_size"], c["context_len"] + c["output_len"] / 2)
        as_int8 = step_time_shape(spec, hw, shape, dtype="int8", kv_dtype="int8")
        as_fp32 = step_time_shape(spec, hw, shape, dtype="fp32")
        assert r["predicteddecode_step_ms"] == pytest.approx(as_int8.total_ms)
        assert as_fp32.weight_s > 3 * as_int8.weight_s  # four bytes a weight against one
    assert rep["summary"]["median_abs_error_tpot_pct"] is not None


def test_a_profile_of_other_dtypes_is_refused(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"measurements": {"dtype": "fp32", "kv_dtype": "fp32"}}))
    check_profile_dtypes(str(profile), "fp32", "fp32")
    with pytest.raises(ValueError, match="calibrated with weights in fp32; this engine's are int8"):
        check_profile_dtypes(str(profile), "int8", "fp32")
    profile.write_text(json.dumps({"measurements": {}}))  # older profiles name no dtype: accepted
    check_profile_dtypes(str(profile), "int8", "fp32")


@pytest.mark.parametrize("args, message", [
    (["--quantization", "int4"], "'int4' is not one of"),
    (["--quantization", "int8", "--disagg", "1+1"], "--quantization and --kv-cache-dtype run on one device"),
    (["--kv-cache-dtype", "fp16"], "'fp16' is not one of"),
])
def test_quantization_flags_reject_bad_input_in_one_line(args, message, tmp_path):
    res = jaxserve("report", "--quick", "--model", "tiny", "--out", str(tmp_path / "r"), *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr


def test_plan_with_quantization_keeps_an_auto_kv_cache_in_dtype_as_the_runtime_does(capsys):
    """`jaxserve plan --quantization int8` prices what `--quantization int8` runs: int8 weights, KV in --dtype."""
    from jaxserve.cli.main import main

    def config(*args):
        with pytest.raises(SystemExit) as exc:
            main(["plan", "--json", "--model", "llama-3.1-8b", "--tp", "1", "--max-num-seqs", "64", *args])
        assert exc.value.code == 0
        return json.loads(capsys.readouterr().out)["config"]

    assert (config("--quantization", "int8")["dtype"], config("--quantization", "int8")["kv_dtype"]) == ("int8", "bf16")
    assert config("--quantization", "fp8", "--kv-cache-dtype", "fp8")["kv_dtype"] == "fp8"
    assert config("--quantization", "int8", "--dtype", "fp32")["kv_dtype"] == "fp32"
