"""scripts/trace_step.py's reading of a trace, on a hand-made profile: a program whose thunks continue on an intra-op
thread after a kernel call belongs to that program whole, and a loop body's nested run is no run of its own."""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # as when the script runs

from trace_step import executions, xla_thunks  # noqa: E402


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
