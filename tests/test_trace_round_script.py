"""scripts/trace_round.py's reading of a trace, on hand-made thunks: a round against a plain decode step of a
two-layer target, a prefill left out, and a trace that holds only one kind refused."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # as when the script runs

from trace_round import OTHER, round_parts, step_parts  # noqa: E402

LAYERS = 2
CALLS = ("qkv", "attention", "o", "gate_up", "down")


def step(t0: int, call_ns: int, head_ns: int, fusion_ns: int, gap_ns: int = 0) -> list[tuple[int, int, str]]:
    """A decode step's thunks from `t0`: per layer a fusion, then the five kernel calls (each `call_ns` long), the
    LM head's call last; `gap_ns` of idle before the head (a plain step's forward-to-sampler gap)."""
    out, t = [], t0
    for layer in range(LAYERS):
        out.append((t, fusion_ns, f"add_rsqrt_fusion.{layer}"))
        t += fusion_ns
        for i, _ in enumerate(CALLS):
            out.append((t, call_ns, f"ffi_call.{layer * 5 + i}"))
            t += call_ns
    t += gap_ns
    out.append((t, head_ns, "ffi_call.99"))
    return out


def test_a_round_and_a_plain_step_by_part_with_host_and_idle_time():
    plain = step(1_000, call_ns=100, head_ns=300, fusion_ns=50, gap_ns=40)
    rnd = step(10_000, call_ns=150, head_ns=450, fusion_ns=80)
    prefill = [(20_000, 5_000, "ffi_call.1"), (25_000, 900, "ynn_fusion")]  # attention calls only: not a decode
    thunks = sorted(plain + rnd + prefill)
    windows = [(900, 4_000), (9_500, 14_000), (19_000, 30_000)]
    res = round_parts(windows, ["plain", "round", "plain"], thunks, LAYERS)

    assert res["plain"]["steps"] == 1 and res["round"]["steps"] == 1  # the prefill step is neither
    assert res["plain"]["parts_us"]["qkv"] == pytest.approx(0.2)  # two layers' calls of 100 ns
    assert res["round"]["parts_us"]["lm_head"] == pytest.approx(0.45)
    assert res["plain"]["parts_us"]["other thunks"] == pytest.approx(0.1)
    assert res["round"]["parts_us"][OTHER + "add_rsqrt_fusion"] == pytest.approx(0.16)  # .0 and .1: one kind
    plain_span = 2 * (50 + 5 * 100) + 40 + 300
    assert res["plain"]["parts_us"]["span"] == pytest.approx(plain_span / 1e3)
    assert res["plain"]["parts_us"]["idle"] == pytest.approx(0.04)
    assert res["round"]["parts_us"]["idle"] == 0
    assert res["plain"]["host_us"] == pytest.approx((3_100 - plain_span) / 1e3)
    assert res["round_over_plain"]["gate_up"] == pytest.approx(1.5)
    assert res["round_over_plain"]["lm_head"] == pytest.approx(1.5)


def test_a_step_without_every_kernel_call_is_no_decode_step():
    thunks = step(0, call_ns=100, head_ns=300, fusion_ns=50)
    assert step_parts(thunks[:-1], LAYERS) is None  # no LM head call: a forward alone
    assert step_parts([], LAYERS) is None
    assert step_parts(thunks, LAYERS)["down"] == 200


def test_a_trace_without_rounds_or_with_other_steps_is_refused():
    thunks = step(1_000, call_ns=100, head_ns=300, fusion_ns=50)
    with pytest.raises(ValueError, match="0 rounds and 1 plain"):
        round_parts([(0, 5_000)], ["plain"], thunks, LAYERS)
    with pytest.raises(ValueError, match="1 traced steps for 2 engine steps"):
        round_parts([(0, 5_000)], ["plain", "round"], thunks, LAYERS)


@pytest.mark.slow  # ~25 s: a warmed bard engine and a traced request
def test_the_script_traces_bards_rounds_and_plain_steps(tmp_path):
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "round.json"
    run = subprocess.run([sys.executable, str(root / "scripts" / "trace_round.py"), "--model", "bard", "--requests",
                          "1", "--output-len", "32", "--out", str(out)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["round"]["steps"] > 0 and res["plain"]["steps"] > 0
    for kind in ("round", "plain"):
        parts = res[kind]["parts_us"]
        assert all(parts[name] > 0 for name in ("qkv", "attention", "o", "gate_up", "down", "lm_head", "span"))
        assert res[kind]["host_us"] > 0
    assert "device span" in run.stdout
