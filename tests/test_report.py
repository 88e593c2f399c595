"""`jaxserve report --quick` (with `--disagg 1+1 --disagg-in-process` where there are two cores): every part runs
and report.json/md/png carry the promised keys; `--disagg` rejects bad input in one line. (The server processes
that `--disagg` measures on a CPU by default: tests/test_report_disagg_servers.py.)"""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from jaxserve.measure.bench.load import RunResult, StepRecord
from jaxserve.measure.bench.results import RequestRecord
from jaxserve.measure.report.chunked import decode_gaps
from jaxserve.measure.report.context import ReportConfig
from jaxserve.measure.report.probe import drift_note
from jaxserve.measure.report.summary import check_context, summarize

ROW_KEYS = {"kind", "config", "predicted_ttft_ms", "measured_ttft_ms", "predicted_tpot_ms", "measured_tpot_ms",
            "predicted_throughput", "measured_throughput", "ttft_error_pct", "tpot_error_pct", "throughput_error_pct"}


CORES = len(os.sched_getaffinity(0))
DISAGG = CORES >= 2  # --disagg 1+1 needs a core per pool


def jaxserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")  # a subprocess: --disagg gives it 2 CPU devices, this process has 1
    disagg = ["--disagg", "1+1", "--disagg-in-process"] if DISAGG else []
    res = jaxserve("report", "--quick", "--model", "tiny", "--out", str(out), *disagg)
    assert res.returncode == 0, res.stderr
    return out


def test_report_files_and_keys(report_dir):
    assert (report_dir / "report.png").stat().st_size > 10_000
    assert (report_dir / "profile.json").exists()
    md = (report_dir / "report.md").read_text()
    assert "## Static grid" in md and "## Online loads" in md and "## Chunked prefill" in md
    rep = json.loads((report_dir / "report.json").read_text())
    kinds = [r["kind"] for r in rep["rows"]]
    assert kinds.count("grid") == 4 and kinds.count("load") == 2 and kinds.count("chunked-prefill") == 2
    for r in rep["rows"]:
        assert set(r) >= ROW_KEYS, ROW_KEYS - set(r)
    loads = [r for r in rep["rows"] if r["kind"] == "load"]
    assert [r["config"]["load_fraction"] for r in loads] == [0.5, 0.9]
    s = rep["summary"]
    assert s["median_abs_error_ttft_pct"] is not None and s["median_abs_error_tpot_pct"] is not None
    assert {"chunked_p99", "unchunked_stall", "chunked_prediction"} <= set(s["met"])
    modes = {r["config"]["mode"]: r for r in rep["rows"] if r["kind"] == "chunked-prefill"}
    assert modes["chunked"]["config"]["step_budget"] < modes["unchunked"]["config"]["step_budget"]
    # The report names the kernels it measured, so two machines' reports can be told apart.
    assert rep["engine"]["attention_backend"] in {"reference", "cpu", "pallas"}
    assert rep["engine"]["attention_backend"] in md


def test_reference_steps_checkpoint_the_machine_between_parts(report_dir):
    """Before the grid and after every part the report times a lone prefill and a few decodes beside their
    predictions, so a reader can tell a machine that slowed down from a planner that is wrong."""
    rep = json.loads((report_dir / "report.json").read_text())
    whens = [p["when"] for p in rep["reference_steps"]]
    assert whens[:4] == ["before the grid", "after the grid", "after the loads", "after the chunked prefill"]
    for p in rep["reference_steps"]:
        for kind in ("prefill", "decode"):
            v = p[kind]
            assert v["measured_ms"] > 0 and v["predicted_ms"] > 0
            assert v["measured_over_predicted"] == pytest.approx(v["measured_ms"] / v["predicted_ms"])
    drift = rep["summary"]["machine_drift"]
    assert set(drift) == {"prefill", "decode"} and all(v >= 1.0 for v in drift.values())
    assert rep["summary"]["machine_steady"] == (drift_note(drift) is None)
    assert "## Reference steps" in (report_dir / "report.md").read_text()


def test_an_unsteady_machine_is_named_in_the_report():
    assert drift_note(None) is None
    assert drift_note({"prefill": 1.02, "decode": 1.10}) is None
    note = drift_note({"prefill": 1.23, "decode": 1.30})
    assert "unsteady" in note and "prefill 1.23x" in note and "decode 1.30x" in note


def test_disagg_rows_measure_each_pool_against_the_planner(report_dir):
    if not DISAGG:
        pytest.skip("one core: --disagg 1+1 is refused")
    from modelspec.spec import load_model_spec
    from planner.disaggregate import pool_balance
    from planner.hardware import load_hardware

    rep = json.loads((report_dir / "report.json").read_text())
    rows = {r["config"]["quantity"]: r for r in rep["rows"] if r["kind"] == "disagg"}
    assert list(rows) == ["prefill_capacity", "decode_capacity", "balance", "kv_bytes_per_request"]
    pre, dec, bal, kv = rows.values()
    assert pre["config"]["pools"] == "1+1" and pre["completed"] == 6
    assert kv["transfers"] == 6 and kv["measured"] == kv["predicted"] == 32 * 512 and kv["error_pct"] == 0
    assert pre["steps"] == 6  # the step budget is one prompt: one whole prompt per prefill step
    assert pre["measured"] == pytest.approx(6 / pre["busy_seconds"])
    assert dec["measured"] == pytest.approx(6 * 3 / dec["busy_seconds"] / 3)  # 3 of the 4 tokens decoded there
    assert dec["steps"] >= 3 and 1 <= dec["decode_batch"] <= 4
    assert bal["measured"] == pytest.approx(pre["measured"] / dec["measured"])
    planned = pool_balance(load_model_spec("tiny"), load_hardware(report_dir / "profile.json"), 32, 4,
                           decode_batch=dec["decode_batch"], dtype="fp32")
    assert pre["predicted"] == pytest.approx(planned.prefill_rps)
    assert dec["predicted"] == pytest.approx(planned.decode_rps)
    assert bal["predicted"] == pytest.approx(planned.balance)
    for r in (pre, dec):
        assert 0 < r["busy_fraction"] <= 1 and 0 <= r["overlap_fraction"] <= 1
        assert r["alone_steps"] + r["shared_steps"] == r["steps"]  # every step checked against the step model
        assert all(r[f"{k}_over_predicted"] > 0 for k in ("alone", "shared") if r[f"{k}_steps"])
    assert rep["summary"]["disagg"]["kv_bytes_per_request"]["error_pct"] == 0
    md = (report_dir / "report.md").read_text()
    assert "## Disaggregated prefill/decode (1+1" in md and "fake devices sharing the same cores" in md


@pytest.mark.parametrize("value", ["3", "0+1", "1+x", "1+1+1"])
def test_disagg_flag_rejects_bad_input_in_one_line(value, capsys):
    from jaxserve.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["report", "--quick", "--disagg", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error:") and "--disagg" in err


def test_disagg_flag_needs_the_devices(tmp_path, capsys):
    import jax

    from jaxserve.cli.main import main

    n = len(jax.devices())  # JAX has started here: the flag cannot add devices to this process any more
    with pytest.raises(SystemExit) as e:
        main(["report", "--quick", "--disagg", f"1+{n}", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip() == f"error: --disagg 1+{n} needs {n + 1} devices; {n} visible"
    r = jaxserve("report", "--quick", "--disagg", f"1+{CORES}", "--out", str(tmp_path))  # fresh: CPU devices
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"needs {CORES + 1} CPU devices but this machine has {CORES} cores" in r.stderr
    assert not (tmp_path / "report.json").exists()


def test_summary_medians():
    rows = [{"kind": "grid", "ttft_error_pct": e, "tpot_error_pct": -e, "throughput_error_pct": None}
            for e in (5.0, -10.0, 20.0)]
    s = summarize(rows)
    assert s["median_abs_error_ttft_pct"] == 10.0 and s["median_abs_error_tpot_pct"] == 10.0
    assert s["met"] == {"tpot": True, "ttft": True}


def test_decode_gaps_are_attributed_to_their_steps():
    steps = [StepRecord(end=e, duration=0.01, num_tokens=1, num_decodes=1, num_prefill_tokens=p)
             for e, p in ((0.1, 0), (0.2, 0), (0.5, 64), (0.6, 0))]
    rec = RequestRecord(prompt_len=4, success=True, output_len=4, role="decode")
    run = RunResult(records=[rec, RequestRecord(prompt_len=9, role="long")], duration=1.0, steps=steps,
                    token_times=[[0.09, 0.19, 0.49, 0.59], [0.49]])
    gaps, quiet, quiet_steps = decode_gaps(run)
    assert gaps == pytest.approx([100.0, 300.0, 100.0])
    assert quiet == pytest.approx([100.0, 100.0])
    assert quiet_steps == [1, 3]  # the steps that produced the later token of each quiet gap


def test_a_report_past_the_context_is_refused_before_anything_runs():
    cfg = ReportConfig.quick_config("tiny")
    check_context(cfg, max_model_len=4096, page_size=16)  # quick sizes fit
    with pytest.raises(ValueError, match="max_model_len is 4096: lower --long-prompt-len"):
        check_context(ReportConfig(model="tiny", long_prompt_len=4096), max_model_len=4096, page_size=16)
    with pytest.raises(ValueError, match="the grid's 5000-token context and its outputs need 5004 tokens"):
        check_context(replace(cfg, context_lens=(16, 5000)), max_model_len=4096, page_size=16)
