"""`jaxserve convert`: an HF safetensors checkpoint into jaxserve's orbax format."""

from __future__ import annotations

import time

import click

from jaxserve.cli.output_paths import check_writable
from jaxserve.config.engine import ARRAY_DTYPES
from modelspec.spec import ModelSpecError


@click.command()
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(ARRAY_DTYPES))
def convert(src: str, dst: str, dtype: str) -> None:
    """Convert an HF safetensors checkpoint folder SRC into jaxserve's orbax format at DST (faster to load)."""
    from jaxserve.model.checkpoint import convert as convert_checkpoint  # JAX loads here, not for --help
    from jaxserve.model.weights import CheckpointError

    check_writable(dst, is_dir=True)
    t = time.perf_counter()
    try:
        out = convert_checkpoint(src, dst, dtype)
    except (CheckpointError, ModelSpecError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"converted {src} -> {out} in {time.perf_counter() - t:.1f}s")
