"""Every instruction-set variant of jaxserve's CPU kernels builds and computes the same products on this machine:
AVX2 (where the CPU has it, emulated on an AVX-512 one) and the portable fallback each in a process of their own
(`cpu_kernel_isa_driver.py`), and the default build says which one this CPU got."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.kernels.cpu import library as cpu_kernels

DRIVER = Path(__file__).with_name("cpu_kernel_isa_driver.py")
ROOT = Path(__file__).resolve().parents[1]
X86 = platform.machine().lower() in ("x86_64", "amd64")


def cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return {f for line in lines if line.startswith(("flags", "Features")) for f in line.split(":", 1)[1].split()}


FLAGS = cpu_flags()
HAS_AVX2 = X86 and {"avx2", "fma"} <= FLAGS


@pytest.fixture(scope="module")
def variant_runs(tmp_path_factory) -> dict[str, dict]:
    """Each variant's driver output, the drivers run side by side (a build is ~12 s on one core)."""
    cache = tmp_path_factory.mktemp("kernels")
    variants = ["portable"] + (["avx2"] if HAS_AVX2 else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    procs = {v: subprocess.Popen([sys.executable, str(DRIVER), v, str(cache)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env) for v in variants}
    out = {}
    for v, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-4000:]
        out[v] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.skipif(not HAS_AVX2, reason="this CPU cannot run AVX2 code")
def test_the_avx2_build_runs_here(variant_runs):
    run = variant_runs["avx2"]
    assert run["isa"] == "avx2" and run["failures"] == []


def test_the_portable_build_runs_here(variant_runs):
    run = variant_runs["portable"]
    assert run["isa"] == "portable" and run["failures"] == []


def test_each_variant_is_cached_under_its_own_key(variant_runs):
    names = [run["library"] for run in variant_runs.values()]
    assert len(set(names)) == len(names)


@pytest.mark.skipif(not cpu_kernels.available(), reason="jaxserve's CPU kernels are not built here")
def test_the_default_build_uses_this_cpus_widest_vectors():
    expected = "avx512" if X86 and "avx512f" in FLAGS else "avx2" if HAS_AVX2 else "portable"
    assert cpu_kernels.isa() == expected
