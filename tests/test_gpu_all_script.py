"""The one prepared GPU check (scripts/gpu_all.sh), end to end on the CPU in its smoke mode (tiny sizes, the same
parts and code), so a lent GPU's few minutes are not spent finding its bugs; and its budget: a part past its
time is cut and reported while the others still run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import gpu_all  # noqa: E402


@pytest.mark.slow  # every part's smoke run, ~1-2 min: run it before asking for a device (BUILD.md, "On a GPU")
def test_the_gpu_check_runs_every_part_and_summarizes_the_figures_on_a_cpu(tmp_path):
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_all.sh"), str(tmp_path), "--smoke"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["smoke"] and list(summary["parts"]) == [name for name, *_ in gpu_all.PARTS]
    for name, part in summary["parts"].items():
        assert part["status"] == "ok" and part["errors"] == {} and part["skipped"] == [], (name, part)
        assert part["measurements"] > 0 and part["figures"], name
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["part"] == name and record["results"], name
        assert (tmp_path / f"{name}.log").read_text(), name
        assert "[gpu_all" in run.stdout and f"part {name}: ok" in run.stdout
    figures = [f for p in summary["parts"].values() for f in p["figures"]]
    for f in figures:  # judged against its target unless unmeasured (no kernel named so on a CPU) or only reported
        assert (f["met"] is None) == (f["value"] is None or f["target"] == "reported"), f
    assert summary["figures_met"] == sum(f["met"] is True for f in figures) > 0
    # the step part traced both loops and read host round trips and copies from its traces
    step = json.loads((tmp_path / "step.json").read_text())["results"]
    for key in ("default trace b1", "default trace b4", "k1 trace b1"):
        t = step[key]
        assert t["kernels_per_step"] > 0 and t["busy_us"] > 0 and t["top_kernels"], key
        assert t["host_round_trips_per_step"] == 0 and (tmp_path / t["trace"]).is_file(), key
    assert step["default tpot b1"]["tpot_ms"] > 0 and step["k1 engine"]["loop"] == "synchronous"
    quantized = json.loads((tmp_path / "quantized.json").read_text())["results"]
    assert {"bf16 engine", "fp8 weights engine", "int8 weights engine", "fp8 KV engine"} <= set(quantized)
    assert (tmp_path / "report_bf16" / "report.json").is_file()
    md = (tmp_path / "summary.md").read_text()
    assert "## Figures against the issues' targets" in md
    assert all(f"| {name} |" in md for name, *_ in gpu_all.PARTS)


def test_a_part_past_its_budget_is_cut_and_reported(tmp_path):
    hang = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    r = gpu_all.run_part("hang", hang, tmp_path, allowed=3)
    assert r["status"].startswith("cut at its budget") and r["seconds"] < 20
    assert "started" in (tmp_path / "hang.log").read_text() and r["record"] == {}
