"""scripts/bench_ngram_lookup.py: the lookup and its one-pass search timed on three sequences, same proposals."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_lookup_and_the_one_pass_search_propose_alike_on_every_sequence():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ngram_lookup.py")], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["copy", "no", "frequent"]
    assert all(line.endswith("same proposals: True") and " us " in line for line in lines)
