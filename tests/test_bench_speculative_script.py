"""scripts/bench_speculative.py end to end on `tiny`: plain and n-gram engines, each with its own loop's plain
engine beside it, paired runs, the per-request step counts and the fused round timed against a forward and
against a whole plain step. The engines skip their warm-up (each would compile every bucket: minutes in the suite);
the test reads what the script reports, not its figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_benchmark_pairs_each_engine_with_its_own_loops_plain_engine(tmp_path):
    out = tmp_path / "spec.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_speculative.py"), "--model", "tiny",
                          "--rounds", "1", "--output-len", "12", "--prompt-len", "48", "--paired",
                          "--async-scheduling", "--time-round", "3", "--no-warmup", "--out", str(out)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["method"], r["task"]): r for r in report["rows"]}
    assert set(rows) == {(m, t) for m in ("plain", "ngram", "plain-async", "ngram-async") for t in ("copy", "plain")}
    copy, chained = rows["ngram", "copy"], rows["ngram-async", "copy"]
    assert copy["baseline"] == "plain" and chained["baseline"] == "plain-async"
    assert copy["same_tokens"] and chained["same_tokens"]
    assert copy["chained_rounds_per_request"] == 0 and copy["empty_rounds_per_request"] == 0
    assert chained["engine_steps_per_request"] > 0 and copy["verify_steps_per_request"] > 0
    assert copy["tpot_ratio_median_of_pairs"] > 0
    timing = report["round_timing"]
    assert set(timing) == {"ngram", "ngram-async"}
    assert timing["ngram"]["round_rows"] == 5  # one sequence, k = 4 drafts and its own token
    assert timing["ngram"]["round_us"] > 0 and timing["ngram"]["forward_us"] > 0
    ngram = timing["ngram"]
    assert ngram["plain_step_us"] > 0 and ngram["round_over_plain_step"] == ngram["round_us"] / ngram["plain_step_us"]
    assert ngram["real_round_us"] > 0 and ngram["real_round_over_plain_step"] == ngram["real_round_us"] / ngram[
        "plain_step_us"]
    assert ngram["round_beside_host_us"] > 0 and ngram["plain_step_beside_host_us"] > 0 and ngram["host_alone_us"] > 0
