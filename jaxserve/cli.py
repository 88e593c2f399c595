"""The `jaxserve` command line: one click group; each command lives with the code it drives.

Every command reports bad input as one line on stderr with exit code 2 (no traceback), by raising
`click.UsageError` (or any `click.ClickException`), which `main` turns into that line.
"""

from __future__ import annotations

import sys

import click

from jaxserve.bench.cli import bench
from jaxserve.calibrate.calibrate import calibrate_command
from jaxserve.engine.args import build_engine, config_from_options, engine_options
from jaxserve.report.report import report_command
from jaxserve.server.cli import serve
from planner.cli import plan


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="jaxserve")
def cli() -> None:
    """jaxserve: JAX LLM inference runtime and capacity planner."""


cli.add_command(plan)
cli.add_command(serve)
cli.add_command(bench)
cli.add_command(calibrate_command)
cli.add_command(report_command)


@cli.command()
@engine_options
@click.option("--prompt", required=True, help="Prompt text (or comma-separated token ids with --token-ids).")
@click.option("--token-ids", is_flag=True, help="Treat --prompt as comma-separated token ids.")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=-1, show_default=True, type=int)
@click.option("--min-p", default=0.0, show_default=True, type=click.FloatRange(0, 1))
@click.option("--ignore-eos", is_flag=True)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
def generate(prompt: str, token_ids: bool, max_tokens: int, temperature: float, top_p: float, top_k: int,
             min_p: float, ignore_eos: bool, stop: tuple[str, ...], **options) -> None:
    """Generate one completion and stream its text to the terminal."""
    from jaxserve.core.sampling_params import SamplingParams

    config = config_from_options(options)
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                max_tokens=max_tokens, ignore_eos=ignore_eos, stop=list(stop))
        ids = [int(t) for t in prompt.split(",")] if token_ids else None
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    engine = build_engine(config, announce=False)
    try:
        engine.add_request("generate-0", ids if ids is not None else prompt, params)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    shown = 0
    out = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.text if engine.tokenizer is not None else " ".join(map(str, out.token_ids)) + " "
            click.echo(text[shown:], nl=False)
            shown = len(text)
    click.echo()
    if out is not None and out.metrics.ttft is not None:
        m = out.metrics
        tpot = f", TPOT {m.tpot * 1e3:.1f} ms" if m.tpot is not None else ""
        click.echo(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
                   f"TTFT {m.ttft * 1e3:.1f} ms{tpot}]", err=True)


@cli.command()
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
def convert(src: str, dst: str, dtype: str) -> None:
    """Convert an HF safetensors checkpoint folder SRC into jaxserve's orbax format at DST (faster to load)."""
    import time

    from jaxserve.model.checkpoint import convert as convert_checkpoint
    from jaxserve.model.weights import CheckpointError
    from jaxserve.output_paths import check_writable
    from planner.model_spec import ModelSpecError

    check_writable(dst, is_dir=True)
    t = time.perf_counter()
    try:
        out = convert_checkpoint(src, dst, dtype)
    except (CheckpointError, ModelSpecError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"converted {src} -> {out} in {time.perf_counter() - t:.1f}s")


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
