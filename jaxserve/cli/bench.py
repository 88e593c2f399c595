"""`jaxserve bench latency` and `jaxserve bench serve` (vLLM's flag names where they exist)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import click
from rich.progress import Progress

from jaxserve.cli.engine_flags import build_engine, config_from_options, engine_options
from jaxserve.cli.output_paths import check_writable
from jaxserve.measure.bench.datasets import DATASETS, DatasetConfig, generate
from jaxserve.measure.bench.http_client import run_http
from jaxserve.measure.bench.latency import format_table, run_grid
from jaxserve.measure.bench.load import LoadConfig, run_engine
from jaxserve.measure.bench.results import compute_metrics, finite, format_summary, parse_goodput
from modelspec.spec import load_model_spec


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"{text!r}: give positive integers")
    return values


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a number or 'inf'") from None
    if not rate > 0:
        raise click.BadParameter("the request rate must be positive (or inf)")
    return rate


def _vocab(model: str) -> tuple[int, tuple[int, ...]]:
    """Vocabulary size and special ids to avoid, from the model's spec (a generic 32000 if unknown)."""
    try:
        spec = load_model_spec(model)
    except ValueError:
        return 32000, ()
    return spec.vocab_size, tuple(i for i in (spec.eos_token_id,) if i is not None)


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


@bench.command("serve")
@engine_options
@click.option("--base-url", default=None, help="An OpenAI-compatible server (else the in-process engine).")
@click.option("--served-model-name", default=None, help="Model name sent to --base-url (default: its first).")
@click.option("--dataset-name", default="random", show_default=True, type=click.Choice(DATASETS))
@click.option("--num-prompts", default=100, show_default=True, type=click.IntRange(min=1))
@click.option("--input-len", default=512, show_default=True, type=click.IntRange(min=1),
              help="Prompt tokens (multi-turn: per user message).")
@click.option("--output-len", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--range-ratio", default=0.0, show_default=True, type=click.FloatRange(0, 1, max_open=True),
              help="Lengths uniform in [L(1-r), L(1+r)].")
@click.option("--prefix-len", default=256, show_default=True, type=click.IntRange(min=0),
              help="shared-prefix: tokens shared within a group.")
@click.option("--num-prefixes", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--turns", default=4, show_default=True, type=click.IntRange(min=1), help="multi-turn: turns each.")
@click.option("--long-prompt-len", default=4096, show_default=True, type=click.IntRange(min=1))
@click.option("--request-rate", default="inf", show_default=True, help="Requests/s (Poisson), or inf.")
@click.option("--burstiness", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Gamma shape of the gaps: 1 Poisson, <1 burstier.")
@click.option("--max-concurrency", default=None, type=click.IntRange(min=1))
@click.option("--goodput", multiple=True, help="SLOs for goodput, e.g. --goodput ttft:500 --goodput tpot:50 (ms).")
@click.option("--metric-percentiles", default="99", show_default=True, help="Comma-separated percentiles.")
@click.option("--save-result", type=click.Path(dir_okay=False), default=None, help="Write the result JSON here.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="Sampling of every request: 0 greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=-1, show_default=True, type=int, help="-1: off.")
@click.option("--min-p", default=0.0, show_default=True, type=float)
def serve_bench(base_url: str | None, served_model_name: str | None, dataset_name: str, num_prompts: int,
                input_len: int, output_len: int, range_ratio: float, prefix_len: int, num_prefixes: int, turns: int,
                long_prompt_len: int, request_rate: str, burstiness: float, max_concurrency: int | None,
                goodput: tuple[str, ...], metric_percentiles: str, save_result: str | None, temperature: float,
                top_p: float, top_k: int, min_p: float, **options) -> None:
    """Online load in vLLM's style; prints the "Serving Benchmark Result" summary."""
    rate = _rate(request_rate)
    seed, model = options["seed"], options["model"]
    try:
        slos = parse_goodput(goodput)
        percentiles = [float(p) for p in metric_percentiles.split(",") if p.strip()]
        dcfg = DatasetConfig(name=dataset_name, num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                             range_ratio=range_ratio, prefix_len=prefix_len, num_prefixes=num_prefixes, turns=turns,
                             long_prompt_len=long_prompt_len, seed=seed)
        load = LoadConfig(request_rate=rate, burstiness=burstiness, max_concurrency=max_concurrency, seed=seed,
                          temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if save_result:
        check_writable(save_result)
    vocab, avoid = _vocab(model)
    requests = generate(dcfg, vocab, avoid)
    if base_url:
        try:
            run = run_http(base_url, requests, load, model=served_model_name)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        backend = "openai"
    else:
        run = _run_in_process(config_from_options(options), requests, load)
        backend = "jaxserve"
    result = compute_metrics(run.records, run.duration, slos or None, percentiles)
    result.update({"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": backend, "model_id": model,
                   "base_url": base_url, "dataset_name": dataset_name, "num_prompts": num_prompts,
                   "request_rate": rate if math.isfinite(rate) else "inf", "burstiness": burstiness,
                   "max_concurrency": max_concurrency, "goodput_slos_ms": slos or None,
                   "sampling": {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}})
    click.echo(format_summary({**result, "request_rate": rate if math.isfinite(rate) else None}, percentiles))
    if errors := sorted({r.error for r in run.records if not r.success}):
        failed = sum(not r.success for r in run.records)
        click.echo(f"{failed} of {len(run.records)} requests failed: {'; '.join(errors[:3])}"
                   + (f" (and {len(errors) - 3} other errors)" if len(errors) > 3 else ""), err=True)
    if save_result:
        Path(save_result).write_text(json.dumps(finite(result)) + "\n")


def _run_in_process(config, requests, load):
    """Build the engine (warm-up included), then drive it with a progress bar."""
    engine = build_engine(config)
    with Progress(transient=True) as progress:
        task = progress.add_task("requests", total=len(requests))
        return run_engine(engine, requests, load, salt=f"serve{int(time.time())}",
                          on_step=lambda done: progress.update(task, completed=done))
