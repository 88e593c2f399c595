"""Running the `jaxserve` command line in the test process: bad-flag checks need no new interpreter (and JAX
start-up) each; one subprocess case per command file keeps the real process covered."""

from __future__ import annotations

import contextlib
import io

import click
import pytest
from click.testing import CliRunner

from jaxserve.cli.engine_flags import config_from_options, engine_options
from jaxserve.cli.main import main
from jaxserve.config.engine import EngineConfig


def run_cli(*args: str) -> tuple[int, str]:
    """Run `jaxserve ARGS` in this process; returns (exit code, what it wrote to stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main(list(args))
    code = exited.value.code
    return (0 if code is None else int(code)), err.getvalue()


def engine_config_from_flags(*argv: str) -> tuple[EngineConfig | None, str]:
    """The EngineConfig the engine flags `argv` build (as every engine command parses them), or None when they are
    refused; and what the command wrote."""
    seen: list[EngineConfig] = []

    @click.command()
    @engine_options
    def command(**options):
        seen.append(config_from_options(options))

    result = CliRunner().invoke(command, list(argv))
    return (seen[0] if result.exit_code == 0 and seen else None), result.output
