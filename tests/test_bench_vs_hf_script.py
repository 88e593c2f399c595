"""scripts/bench_vs_hf.py on `tiny` without its peers: warm-up, timed runs each with its own bandwidth and floor,
the medians per row."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_vs_hf.py"


def test_every_run_has_its_own_floor_and_the_row_its_medians(tmp_path):
    out = tmp_path / "vs.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--skip-hf", "--batches", "1,2",
                          "--prompt-len", "8", "--new-tokens", "4", "--repeats", "3", "--measure-bandwidth",
                          "--out", str(out)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        assert len(row["runs"]) == 3 and "llamacpp_e2e_s" not in row
        for r in row["runs"]:
            assert r["bandwidth_gbps"] > 0
            assert r["tpot_over_floor"] == pytest.approx(r["jaxserve_tpot_ms"] / r["floor_ms"])
        assert row["jaxserve_e2e_s"] == sorted(r["jaxserve_e2e_s"] for r in row["runs"])[1]
