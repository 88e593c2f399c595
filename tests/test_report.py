"""`jaxserve report --quick`: every part runs and report.json/md/png carry the promised keys."""

import json

import pytest
from click.testing import CliRunner

from jaxserve.bench.load import RunResult, StepRecord
from jaxserve.bench.results import RequestRecord
from jaxserve.report import summarize
from jaxserve.report_chunked import decode_gaps

ROW_KEYS = {"kind", "config", "predicted_ttft_ms", "measured_ttft_ms", "predicted_tpot_ms", "measured_tpot_ms",
            "predicted_throughput", "measured_throughput", "ttft_error_pct", "tpot_error_pct", "throughput_error_pct"}


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    from jaxserve.cli import cli

    out = tmp_path_factory.mktemp("report")
    res = CliRunner().invoke(cli, ["report", "--quick", "--model", "tiny", "--out", str(out)])
    assert res.exit_code == 0, res.output
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
    gaps, quiet = decode_gaps(run)
    assert gaps == pytest.approx([100.0, 300.0, 100.0])
    assert quiet == pytest.approx([100.0, 100.0])
