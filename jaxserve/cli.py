"""The `jaxserve` command line: one click group; each command lives with the code it drives.

Every command reports bad input as one line on stderr with exit code 2 (no traceback), by raising
`click.UsageError` (or any `click.ClickException`), which `main` turns into that line.
"""

from __future__ import annotations

import sys

import click

from planner.cli import plan


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="jaxserve")
def cli() -> None:
    """jaxserve: JAX LLM inference runtime and capacity planner."""


cli.add_command(plan)


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
