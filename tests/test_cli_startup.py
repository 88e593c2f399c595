"""A new user's first minutes with the command line: help without JAX, and long start-up work that reports what
it is doing, n of m, as plain lines off a terminal and as a live bar on one."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from jaxserve.cli.generate import _visible
from jaxserve.cli.log_setup import JobProgress, ProgressHandler, setup_logging
from jaxserve.core.progress import step

ROOT = Path(__file__).resolve().parents[1]
HELPS = [[], ["plan"], ["serve"], ["generate"], ["bench", "serve"], ["bench", "latency"], ["calibrate"], ["report"],
         ["convert"], ["eval", "perplexity"]]


def test_help_of_every_command_loads_no_jax() -> None:
    script = ("import contextlib, io, sys\nfrom jaxserve.cli.main import main\n"
              f"for args in {HELPS!r}:\n"
              "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
              "        try:\n            main([*args, '--help'])\n        except SystemExit as e:\n"
              "            assert e.code in (0, None), (args, e.code)\n"
              "    assert 'Usage:' in out.getvalue(), args\n"
              "print(sorted(m for m in ('jax', 'jaxlib', 'flax', 'uvicorn') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_progress_records_are_plain_lines_off_a_terminal(capsys) -> None:
    setup_logging(terminal=False)
    log = logging.getLogger("jaxserve.test")
    for i in range(3):
        log.info("compiling the forward step: %d tokens (%d of 3)", 16 << i, i + 1, extra=step("compiling", i, 3))
    err = capsys.readouterr().err.splitlines()
    assert [line.split(": ", 1)[1] for line in err] == [
        "compiling the forward step: 16 tokens (1 of 3)", "compiling the forward step: 32 tokens (2 of 3)",
        "compiling the forward step: 64 tokens (3 of 3)"]
    assert all(" INFO jaxserve.test" in line for line in err)  # timestamped, levelled, named


def test_a_terminal_shows_a_bar_and_keeps_each_tasks_last_line() -> None:
    out = io.StringIO()
    handler = ProgressHandler(Console(file=out, force_terminal=True, width=120))
    log = logging.getLogger("jaxserve.test.bar")
    log.addHandler(handler)
    log.propagate = False
    try:
        for i in range(4):
            log.info("timing (%d of 4)", i + 1, extra=step("timing the kernels", i, 4))
        log.info("timing: done", extra=step("timing the kernels", 4, 4))
        log.info("an ordinary line")
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    assert "timing: done" in text and "an ordinary line" in text
    assert "3/4" in text  # the bar's n of m, drawn while the task ran


def test_a_job_off_a_terminal_prints_a_line_each_tenth(capsys) -> None:
    with JobProgress("requests", 20, terminal=False) as bar:
        for done in range(1, 21):
            bar.update(done)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"requests: {n} of 20" for n in range(2, 21, 2)]


def test_text_a_terminal_would_show() -> None:
    assert _visible("ROMEO: hi") and not _visible("\n \t\ufffd\x01")
