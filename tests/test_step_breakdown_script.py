"""scripts/step_breakdown.py end to end on `tiny`: one request's decode step against the weight-read floor
measured in the same process, part by part (llama.cpp's side needs llama-cpp-python and its source, not here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_breakdown_times_every_part_of_a_step_against_the_measured_floor(tmp_path):
    out = tmp_path / "breakdown.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "step_breakdown.py"), "--model", "tiny", "--steps",
                          "3", "--stream-mib", "64", "--out", str(out)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["bandwidth_gbps"] > 0 and report["floor_ms"] > 0
    js = report["jaxserve"]
    # untraced steps and traced calls are timed apart: on a shared machine either may be the slower
    assert js["step_ms"] > 0 and js["forward_ms"] > 0 and js["sampler_ms"] >= js["lm_head_ms"] > 0
    assert js["step_over_floor"] == js["step_ms"] / report["floor_ms"]
    assert js["parts"]["attention"]["ms"] > 0  # the attention kernel's calls were found in the forward
    assert set(report["floors_ms"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert "floor" in run.stdout and report["llamacpp"] is None
