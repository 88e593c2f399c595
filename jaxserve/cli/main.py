"""The `jaxserve` command line: one click group; each command lives with the code it drives.

Commands are imported when they run (`LazyGroup`), so `jaxserve plan` never loads JAX and `jaxserve --help`
imports no command at all (it lists `SUMMARIES`). Every command reports
bad input as one line on stderr with exit code 2 (no traceback), by raising `click.UsageError` (or any
`click.ClickException`), which `main` turns into that line.
"""

from __future__ import annotations

import importlib
import sys

import click

# Command name -> "module:attribute" of its click command.
COMMANDS = {
    "plan": "jaxserve.cli.plan:plan",
    "serve": "jaxserve.cli.serve:serve",
    "router": "jaxserve.cli.router:router",
    "generate": "jaxserve.cli.generate:generate",
    "bench": "jaxserve.cli.bench:bench",
    "calibrate": "jaxserve.cli.calibrate:calibrate_command",
    "report": "jaxserve.cli.report:report_command",
    "convert": "jaxserve.cli.convert:convert",
    "eval": "jaxserve.cli.eval:eval_group",
}

# Command name -> the line `jaxserve --help` shows for it, so the listing imports no command (a command missing
# here is imported to read its own docstring).
SUMMARIES = {
    "plan": "Plan a deployment and predict its TTFT, TPOT and throughput (no JAX).",
    "serve": "Serve a model over an OpenAI-compatible HTTP API (default model: bard).",
    "router": "One OpenAI endpoint in front of several servers (replicas, or prefill and decode).",
    "generate": "Generate one completion and stream its text to the terminal.",
    "bench": "Benchmarks: static-batch latency grids and online serving load.",
    "calibrate": "Measure this device and the engine into a hardware profile.",
    "report": "Measured against predicted: the planner's error on this machine.",
    "convert": "Convert an HF safetensors checkpoint into jaxserve's format.",
    "eval": "Evaluate a model through the engine (perplexity over a text).",
}


class LazyGroup(click.Group):
    """A click group whose commands are imported on first use."""

    def __init__(self, *args, lazy: dict[str, str], summaries: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy
        self.summaries = summaries or {}

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from `summaries` (no import), else from the command's own short help."""
        rows = []
        for name in self.list_commands(ctx):
            text = self.summaries.get(name)
            if text is None:
                cmd = self.get_command(ctx, name)
                text = cmd.get_short_help_str(formatter.width) if cmd is not None else ""
            rows.append((name, text))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self.lazy)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.lazy:
            return None
        module, attr = self.lazy[name].split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, lazy=COMMANDS, summaries=SUMMARIES,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="jaxserve")
def cli() -> None:
    """jaxserve: JAX LLM inference runtime and capacity planner."""


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the group, mapping usage errors to one line and exit code 2."""
    try:
        rv = cli.main(args=argv, prog_name="jaxserve", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(2)
    sys.exit(rv if isinstance(rv, int) else 0)
