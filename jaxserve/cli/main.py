"""The `jaxserve` command line: one click group; each command lives with the code it drives.

Commands are imported when they run (`LazyGroup`), so `jaxserve plan` never loads JAX. Every command reports
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


class LazyGroup(click.Group):
    """A click group whose commands are imported on first use."""

    def __init__(self, *args, lazy: dict[str, str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self.lazy)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.lazy:
            return None
        module, attr = self.lazy[name].split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, lazy=COMMANDS,
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
