"""scripts/trace_step.py's reading of a trace, on a hand-made profile: a program whose thunks continue on an intra-op
thread after a kernel call belongs to that program whole, and a loop body's nested run is no run of its own."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # as when the script runs

from trace_step import executions, loop_parts, xla_thunks  # noqa: E402


def line(name: str, *events: tuple[int, int, str]) -> SimpleNamespace:
    return SimpleNamespace(name=name, events=[SimpleNamespace(start_ns=s, duration_ns=d, name=n)
                                              for s, d, n in events])


def profile(*lines: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(planes=[SimpleNamespace(lines=list(lines))])


def test_a_program_continued_on_an_intra_op_thread_keeps_its_thunks_and_its_end():
    client = line("tf_XLAPjRtCpuClient/1",
                  (100, 300, "ThunkExecutor::Execute"), (110, 50, "fusion.1"), (170, 200, "ffi_call.1"),
                  (1_000, 100, "ThunkExecutor::Execute"), (1_010, 80, "fusion.2"))
    helper = line("tf_XLAEigen/7",
                  (200, 100, "ThreadpoolListener::StartRegion"),  # a marker, not a thunk
                  (380, 120, "ffi_call.2"), (510, 40, "fusion.3"))  # the first program's tail, after its call
    host = line("python", (0, 5_000, "jaxserve-traced-step"))  # not XLA's: never a thunk
    p = profile(client, helper, host)

    names = [t[2] for t in xla_thunks(p)]
    assert names == ["fusion.1", "ffi_call.1", "ffi_call.2", "fusion.3", "fusion.2"]
    first, second = executions(p)
    assert [t[2] for t in first[2]] == ["fusion.1", "ffi_call.1", "ffi_call.2", "fusion.3"]
    assert (first[0], first[1]) == (100, 450)  # to fusion.3's end at 550, past the client thread's 400
    assert [t[2] for t in second[2]] == ["fusion.2"] and second[1] == 100


def test_a_loop_bodys_nested_execution_is_part_of_its_program():
    client = line("tf_XLAPjRtCpuClient/1",
                  (0, 1_000, "ThunkExecutor::Execute"), (100, 300, "ThunkExecutor::Execute"),  # the body, nested
                  (150, 100, "fusion.body"), (2_000, 50, "ThunkExecutor::Execute"), (2_010, 20, "fusion.next"))
    runs = executions(profile(client))
    assert [(r[0], r[1]) for r in runs] == [(0, 1_000), (2_000, 50)]
    assert [t[2] for t in runs[0][2]] == ["fusion.body"]


def test_a_k_step_run_reads_per_step_with_the_head_as_xla_dot_and_its_idle_time():
    spec = SimpleNamespace(num_layers=2, hidden_size=4, head_dim=2, num_heads=2, num_kv_heads=1, intermediate_size=8)
    events, t = [(0, 100, "ThunkExecutor::Execute")], 10  # the client thread's own span ends early: async tail
    for _ in range(2):  # two decode steps in one run
        for i in range(2 * 5):  # two layers' qkv, attention, o, gate_up, down
            events.append((t, 100, f"ffi_call.{i}"))
            t += 100
        events.append((t, 500, "copy_dot_fusion"))  # the LM head, XLA's dot
        t += 500 + 40  # 40 ns idle before the draw
        events.append((t, 20, "ynn_fusion"))
        t += 20
    p = profile(line("tf_XLAPjRtCpuClient/1", *events[:1]), line("tf_XLAEigen/3", *events[1:]))

    res = loop_parts(p, spec, k=2)
    parts = {kind: part["ms"] * 1e6 for kind, part in res["parts"].items()}  # ns a step
    assert parts["qkv"] == parts["down"] == 200  # two layers' calls of 100 ns
    assert parts["lm_head"] == 500 and parts["other thunks"] == 20
    assert parts["idle"] == 10 / 2 + 40  # the run's start to its first thunk, halved; the gap before each draw
    assert parts["run"] == t / 2
    assert res["parts"]["gate_up"]["weight_gbps"] == pytest.approx(2 * 4 * 16 * 4 / 200)


def test_a_trace_without_k_steps_a_run_is_refused():
    spec = SimpleNamespace(num_layers=2, hidden_size=4, head_dim=2, num_heads=2, num_kv_heads=1, intermediate_size=8)
    one_step = [(0, 2_000, "ThunkExecutor::Execute")] + [(10 + 100 * i, 100, f"ffi_call.{i}") for i in range(10)]
    with pytest.raises(ValueError, match="no run holds 4 steps"):
        loop_parts(profile(line("tf_XLAPjRtCpuClient/1", *one_step)), spec, k=4)
