"""`jaxserve bench latency` and `jaxserve bench serve` (vLLM's flag names where they exist)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from jaxserve.cli.engine_flags import build_engine, config_from_options, engine_options
from jaxserve.cli.output_paths import check_writable
from jaxserve.measure.bench.latency import format_table, run_grid


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"{text!r}: give positive integers")
    return values


@click.group()
def bench() -> None:
    """Benchmarks: static-batch latency grids and online serving load."""


@bench.command("latency")
@engine_options
@click.option("--batch-sizes", default="1,4,16", show_default=True, help="Comma-separated batch sizes.")
@click.option("--input-lens", default="128,512", show_default=True, help="Comma-separated prompt lengths.")
@click.option("--output-len", default=16, show_default=True, type=click.IntRange(min=2))
@click.option("--output-json", type=click.Path(dir_okay=False), default=None, help="Write the grid as JSON.")
def latency(batch_sizes: str, input_lens: str, output_len: int, output_json: str | None, **options) -> None:
    """Static batches: prefill time per input length and decode TPOT per batch size."""
    sizes, lens = _int_list(batch_sizes), _int_list(input_lens)
    seed = options["seed"]
    config = config_from_options(options)
    if max(sizes) > config.max_num_seqs:
        raise click.UsageError(f"batch size {max(sizes)} exceeds --max-num-seqs {config.max_num_seqs}")
    if output_json:
        check_writable(output_json)
    engine = build_engine(config)
    if max(lens) + output_len > engine.max_model_len:
        raise click.UsageError(f"--input-lens {max(lens)} plus --output-len {output_len} exceed the model's "
                               f"max_model_len {engine.max_model_len}")
    try:
        points = run_grid(engine, sizes, lens, output_len, seed=seed,
                          on_point=lambda p: click.echo(f"  batch {p.batch_size} x {p.input_len}: "
                                                        f"TPOT {p.tpot_ms:.2f} ms, TTFT {p.ttft_ms:.1f} ms", err=True))
    except ValueError as e:  # also: every request of a point failed (e.g. a KV pool too small for the batch)
        raise click.UsageError(str(e)) from None
    click.echo(format_table(points))
    if output_json:
        Path(output_json).write_text(json.dumps({"model": config.model, "engine": _engine_dict(config),
                                                 "points": [p.to_dict() for p in points]}, indent=2) + "\n")


def _engine_dict(config) -> dict:
    return {k: v for k, v in asdict(config).items() if k not in ("compilation_cache_dir",)}


from jaxserve.cli.bench_serve import serve_bench  # noqa: E402 (registered on the group above)

bench.add_command(serve_bench)
