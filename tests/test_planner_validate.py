"""The benchmark target: default priors against published TensorRT-LLM, NIM and vLLM measurements."""

import subprocess
import sys
from pathlib import Path

from planner.validate import compare_all, load_points, median_abs_errors

ROOT = Path(__file__).resolve().parents[1]


def test_every_published_point_names_its_source():
    for p in load_points():
        assert p["source"]["url"].startswith("https://") and p["source"]["title"], p["id"]


def test_median_errors_meet_the_target():
    rows = compare_all()
    med = median_abs_errors(rows)
    assert med["tpot"] <= 0.25, med
    assert med["ttft"] <= 0.35, med
    loop = median_abs_errors([r for r in rows if r.closed_loop])  # the closed-loop runs, waves and all
    assert loop["ttft"] <= 0.20, loop


def test_closed_loop_points_name_their_run():
    loops = [p for p in load_points() if p["kind"] == "serving_concurrency"]
    assert len(loops) >= 24 and {"h200", "mi300x"} <= {p["hardware"] for p in loops}
    for p in loops:
        assert p["concurrency"] >= 1 and p.get("scheduler", "mixed") in ("mixed", "prefill-first"), p["id"]


def test_validation_script_prints_the_table():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "validate_planner.py")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| point | metric |" in out.stdout and "median |error|" in out.stdout
