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
    med = median_abs_errors(compare_all())
    assert med["tpot"] <= 0.25, med
    assert med["ttft"] <= 0.35, med


def test_validation_script_prints_the_table():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "validate_planner.py")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| point | metric |" in out.stdout and "median |error|" in out.stdout
