"""scripts/bench_kernel_variants.py on `tiny`: two builds of the matmul kernel side by side in one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.kernels.cpu import library as cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_kernel_variants.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.skipif(not cpu_kernels.available(), reason="jaxserve's CPU kernels are not built on this machine")
def test_two_variants_are_timed_against_the_first(tmp_path):
    out = tmp_path / "variants.json"
    run = _run("--variant", "g8:kRowGroup=8", "--variant", "g4:kRowGroup=4,kRowPrefetchRows=4", "--model", "tiny",
               "--layers", "2", "--rounds", "2", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"g8", "g4"} and rows["g8"]["ratio_to_first"] == 1.0
    assert rows["g4"]["constants"] == {"kRowGroup": 4, "kRowPrefetchRows": 4} and rows["g4"]["ms"] > 0


def test_a_constant_the_kernel_lacks_is_a_usage_error():
    run = _run("--variant", "x:kNoSuchConstant=3", "--rounds", "1")
    assert run.returncode == 2 and "kNoSuchConstant" in run.stderr and "Traceback" not in run.stderr
