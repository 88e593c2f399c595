"""Shared fixtures: one small-bucket `tiny` engine for the whole session (JAX compiles dominate test time)."""

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

import pytest

# warmup=False: a test's engine compiles the shapes its test runs, when it first runs them (a warmed tiny engine
# compiles every bucket: 15 s without a compilation cache, against 1 s for a short generate).
TINY_ENGINE_ARGS = dict(max_num_seqs=16, max_num_batched_tokens=128, chunk_size=64, page_size=16,
                        kv_cache_memory=8 * 2**20, max_model_len=1024, warmup=False)


# No persistent compilation cache in the suite, nor in the servers and commands it starts (jax's own switch,
# inherited by subprocesses): jax 0.10.2's CPU client crashed test workers while serializing or loading cache
# entries, in CI and in clean clones here (docs/tuning.md), and a worker lost stops the run. Engines in one process
# still share compiles through the session fixtures; test_compilation_cache.py tests the engine's writes on jax's
# cache class itself.
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"


@pytest.fixture(scope="session", autouse=True)
def _no_persistent_compilation_cache():
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # where jax was imported before this file
    yield


@pytest.fixture(scope="session", autouse=True)
def _kernel_plans_of_their_own():
    """Kernel plans timed here are timed while the other worker runs tests beside them: they go to a file of the
    suite's own, kept whatever ran beside them (an engine would otherwise time its plan at every start), so that
    an engine started outside the suite on this machine never takes them as its plan."""
    from jaxserve.platform import cpu_contention, kernel_choice

    saved = kernel_choice.PLAN_SUFFIX, cpu_contention.OTHERS_MAX_CORES
    kernel_choice.PLAN_SUFFIX, cpu_contention.OTHERS_MAX_CORES = ".tests.plan.json", float("inf")
    yield
    kernel_choice.PLAN_SUFFIX, cpu_contention.OTHERS_MAX_CORES = saved


@pytest.fixture(scope="session")
def tiny_llm():
    from jaxserve import LLM

    return LLM(model="tiny", **{**TINY_ENGINE_ARGS, "warmup": True})  # warm: tests check nothing compiles after


def _locks() -> tuple[Path, Path]:
    """A gate and a run lock shared by this session's xdist workers (children of one controller)."""
    session = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    base = Path(tempfile.gettempdir()) / f"jaxserve-tests-{session}"
    return base.with_suffix(".gate"), base.with_suffix(".run")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    """A test marked `exclusive` (timing on the 2 shared cores) runs while the other worker waits between tests:
    every test passes the gate and holds the run lock shared; an exclusive one holds the gate and the run lock."""
    exclusive = item.get_closest_marker("exclusive") is not None
    gate_path, run_path = _locks()
    with contextlib.ExitStack() as stack:
        gate = stack.enter_context(open(gate_path, "a"))
        run = stack.enter_context(open(run_path, "a"))
        fcntl.flock(gate, fcntl.LOCK_EX)  # no shared holder gets past while an exclusive test waits for the run
        if exclusive:
            fcntl.flock(run, fcntl.LOCK_EX)
        else:
            fcntl.flock(run, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
