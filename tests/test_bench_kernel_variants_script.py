"""scripts/bench_kernel_variants.py on `tiny`: builds of the matmul kernel (other constants, another source file)
side by side in one process, over the projections or the tied head."""

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
    run = _run("--variant", "g8:kRowGroupNarrow=8,kRowGroupWide=8", "--variant",
               "g4:kRowGroupNarrow=4,kRowGroupWide=4,kRowPrefetchRows=4", "--model", "tiny", "--layers", "2",
               "--rounds", "2", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"g8", "g4"} and rows["g8"]["ratio_to_first"] == 1.0
    assert rows["g4"]["constants"] == {"kRowGroupNarrow": 4, "kRowGroupWide": 4, "kRowPrefetchRows": 4}
    assert rows["g4"]["ms"] > 0


@pytest.mark.skipif(not cpu_kernels.available(), reason="jaxserve's CPU kernels are not built on this machine")
def test_the_head_compares_another_source_file_with_the_tree(tmp_path):
    other = tmp_path / "other.cc"
    other.write_text((ROOT / "jaxserve" / "kernels" / "cpu" / "matmul.cc").read_text())
    out = tmp_path / "head.json"
    run = _run("--head", "--variant", f"other:@{other}", "--variant", "tree:", "--model", "tiny", "--layers", "2",
               "--rounds", "2", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["workload"] == "head" and [r["variant"] for r in report["rows"]] == ["other", "tree"]
    assert report["rows"][0]["source"] == str(other) and report["rows"][1]["ms"] > 0


def test_a_constant_the_kernel_lacks_is_a_usage_error():
    run = _run("--variant", "x:kNoSuchConstant=3", "--rounds", "1")
    assert run.returncode == 2 and "kNoSuchConstant" in run.stderr and "Traceback" not in run.stderr
    missing = _run("--variant", "x:@/no/such/file.cc", "--rounds", "1")
    assert missing.returncode == 2 and "no file" in missing.stderr and "Traceback" not in missing.stderr
