"""The prepared GPU kernel microbenchmarks (scripts/gpu_kernels.py), end to end on the CPU with `tiny` and the kernels
interpreted, so a lent GPU's few minutes are not spent finding its bugs."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_kernels_script_times_and_checks_every_variant_on_a_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_kernels.py"), "--cpu-smoke", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert report["failed"] == [] and report["copy"]["gbps"] > 0
    (case,) = report["attention"].values()
    backends = [name for name, r in case.items() if isinstance(r, dict)]
    assert len(backends) == 5 and backends[0].startswith("split auto") and case["splits_auto"] >= 1
    for name in backends:  # every backend ran, was timed and agrees with the jnp reference
        assert case[name]["us_per_layer"] > 0 and case[name]["max_abs_error"] < 1e-4, (name, case[name])
    assert set(report["matmul"]) == {f"tiny {p} {k}" for p in ("qkv", "down") for k in ("float", "int8", "fp8")}
    for label, group in report["matmul"].items():
        r = group["rows 3"]
        assert r["kernel"]["us"] > 0 and r["xla"]["us"] > 0 and r["kernel"]["of_copy"] > 0, (label, r)
        assert r["max_rel_error"] < 1e-4, (label, r)  # float32 activations: kernel and XLA agree to rounding
        assert r["xla_kernels"], label
        assert r["other_tiles_us"] and all(us > 0 for us in r["other_tiles_us"].values()), (label, r)
    md = (tmp_path / "gpu_kernels.md").read_text()
    assert "| 2 x 48 | ragged kernel |" in md and "| tiny down int8 | 3 |" in md and "Other tiles" in md
