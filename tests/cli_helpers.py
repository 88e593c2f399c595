"""Running the `jaxserve` command line in the test process: bad-flag checks need no new interpreter (and JAX
start-up) each; one subprocess case per command file keeps the real process covered."""

from __future__ import annotations

import contextlib
import io

import pytest

from jaxserve.cli.main import main


def run_cli(*args: str) -> tuple[int, str]:
    """Run `jaxserve ARGS` in this process; returns (exit code, what it wrote to stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main(list(args))
    code = exited.value.code
    return (0 if code is None else int(code)), err.getvalue()
