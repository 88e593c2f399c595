"""The prepared GPU run of quantized weights and KV (scripts/gpu_quantized.py), end to end on the CPU with `tiny`,
so a lent GPU's few minutes are not spent finding its bugs."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_quantized_script_measures_every_variant_on_a_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_quantized.py"), "--cpu-smoke", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_quantized.json").read_text())
    variants = report["variants"]
    assert list(variants) == ["plain", "int8 weights", "fp8 weights", "fp8 KV"]
    for label, r in variants.items():
        assert "error" not in r, (label, r)
        assert r["decode_1"]["step_ms"] > 0 and 0 < r["decode_1"]["mbu"] < 1
    # the quantized engines hold their weights as codes: well under the float engine's parameter bytes
    assert variants["int8 weights"]["parameter_bytes"] < 0.7 * variants["plain"]["parameter_bytes"]
    assert variants["int8 weights"]["planner_dtypes"] == ["int8", "fp32"]
    assert variants["fp8 KV"]["planner_dtypes"] == ["fp32", "fp8"]
    assert "| int8 weights |" in (tmp_path / "gpu_quantized.md").read_text()
