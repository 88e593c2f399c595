"""`jaxserve bench serve`: online load in vLLM's style, against a server (`--base-url`) or an engine in process.

Lengths left unset fit the model's context (the server's /v1/models `max_model_len`, or the engine's), so the
defaults work against `jaxserve serve`'s default model. Every request failing is an error (exit 2). With
`--base-url`, the engine flags do not apply: `--help` after `--base-url` leaves them out, and giving one is
refused.
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from jaxserve.cli.engine_flags import ENGINE_OPTION_NAMES, build_engine, config_from_options, serving_engine_options
from jaxserve.cli.log_setup import JobProgress
from jaxserve.cli.output_paths import check_writable
from jaxserve.measure.bench.datasets import DATASETS, DatasetConfig, fit_lengths, generate
from jaxserve.measure.bench.http_client import run_http, served_model
from jaxserve.measure.bench.load import LoadConfig, run_engine
from jaxserve.measure.bench.results import compute_metrics, finite, format_summary, parse_goodput
from modelspec.spec import load_model_spec

# The engine flags that mean nothing to a remote server (--seed also seeds the dataset, so it stays).
ENGINE_ONLY = tuple(n for n in ENGINE_OPTION_NAMES if n != "seed")


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a number or 'inf'") from None
    if not rate > 0:
        raise click.BadParameter("the request rate must be positive (or inf)")
    return rate


def _vocab(model: str | None) -> tuple[int, tuple[int, ...]]:
    """Vocabulary size and special ids to avoid, from the model's spec (a generic 32000 if unknown)."""
    try:
        spec = load_model_spec(model or "")
    except ValueError:
        return 32000, ()
    return spec.vocab_size, tuple(i for i in (spec.eos_token_id,) if i is not None)


def _remote(args: list[str]) -> bool:
    return any(a == "--base-url" or a.startswith("--base-url=") for a in args)


class LoadCommand(click.Command):
    """A command whose help, after `--base-url`, shows only the flags that apply to a remote server."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["bench_remote"] = _remote(args)
        return super().parse_args(ctx, args)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [p.get_help_record(ctx) for p in self.get_params(ctx)
                if not (ctx.meta.get("bench_remote") and p.name in ENGINE_ONLY)]
        with formatter.section("Options"):
            formatter.write_dl([r for r in rows if r is not None])


@click.command("serve", cls=LoadCommand)
@serving_engine_options
@click.option("--base-url", default=None, help="An OpenAI-compatible server (else an engine in this process, built "
                                               "from the engine flags).")
@click.option("--served-model-name", default=None, help="Model name sent to --base-url (default: its first).")
@click.option("--dataset-name", default="random", show_default=True, type=click.Choice(DATASETS))
@click.option("--num-prompts", default=100, show_default=True, type=click.IntRange(min=1))
@click.option("--input-len", default=None, type=click.IntRange(min=1),
              help="Prompt tokens (multi-turn: per user message); default 512, less where the context is shorter.")
@click.option("--output-len", default=None, type=click.IntRange(min=1),
              help="Output tokens; default 64, less where the context is shorter.")
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
@click.pass_context
def serve_bench(ctx: click.Context, base_url: str | None, served_model_name: str | None, dataset_name: str,
                num_prompts: int, input_len: int | None, output_len: int | None, range_ratio: float, prefix_len: int,
                num_prefixes: int, turns: int, long_prompt_len: int, request_rate: str, burstiness: float,
                max_concurrency: int | None, goodput: tuple[str, ...], metric_percentiles: str,
                save_result: str | None, temperature: float, top_p: float, top_k: int, min_p: float,
                **options: Any) -> None:
    """Online load in vLLM's style; prints the "Serving Benchmark Result" summary. Against --base-url, or an engine
    built here from the engine flags (`--base-url URL --help` lists only the flags that apply to a server)."""
    rate = _rate(request_rate)
    seed = options["seed"]
    if base_url:
        given = [n for n in ENGINE_ONLY if n in options
                 and ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise click.UsageError(f"{flag} configures an engine in this process; with --base-url the server's own "
                                   "flags apply (see `jaxserve bench serve --base-url URL --help`)")
    try:
        slos = parse_goodput(goodput)
        percentiles = [float(p) for p in metric_percentiles.split(",") if p.strip()]
        load = LoadConfig(request_rate=rate, burstiness=burstiness, max_concurrency=max_concurrency, seed=seed,
                          temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if save_result:
        check_writable(save_result)
    engine = None
    if base_url and served_model_name and input_len and output_len:  # nothing to ask the server
        model, context = served_model_name, None
    elif base_url:
        try:
            served = served_model(base_url)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        model, context = served.root or served.id, served.max_model_len
        served_model_name = served_model_name or served.id
    else:
        model = options["model"]
        engine = build_engine(config_from_options(options))
        context = engine.max_model_len
    try:
        if context is not None:
            input_len, output_len = fit_lengths(context, dataset_name, turns, range_ratio, input_len, output_len)
        dcfg = DatasetConfig(name=dataset_name, num_prompts=num_prompts, input_len=input_len or 512,
                             output_len=output_len or 64, range_ratio=range_ratio, prefix_len=prefix_len,
                             num_prefixes=num_prefixes, turns=turns, long_prompt_len=long_prompt_len, seed=seed)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"{num_prompts} {dataset_name} requests of {dcfg.input_len} prompt and {dcfg.output_len} output "
               f"tokens to {base_url or 'the engine in this process'} (model {model}"
               + (f", max_model_len {context})" if context else ")"), err=True)
    requests = generate(dcfg, *_vocab(model))
    with JobProgress("requests", len(requests)) as bar:
        if engine is None:
            try:
                run = run_http(base_url, requests, load, model=served_model_name, on_done=bar.update)
            except ValueError as e:
                raise click.UsageError(str(e)) from None
        else:
            run = run_engine(engine, requests, load, salt=f"serve{int(time.time())}", on_step=bar.update)
    result = compute_metrics(run.records, run.duration, slos or None, percentiles)
    result.update({"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai" if base_url else "jaxserve",
                   "model_id": model, "base_url": base_url, "dataset_name": dataset_name, "num_prompts": num_prompts,
                   "request_rate": rate if math.isfinite(rate) else "inf", "burstiness": burstiness,
                   "max_concurrency": max_concurrency, "goodput_slos_ms": slos or None,
                   "sampling": {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}})
    click.echo(format_summary({**result, "request_rate": rate if math.isfinite(rate) else None}, percentiles))
    if save_result:
        Path(save_result).write_text(json.dumps(finite(result)) + "\n")
    failed = [r for r in run.records if not r.success]
    if errors := sorted({r.error for r in failed}):
        message = (f"{len(failed)} of {len(run.records)} requests failed: {'; '.join(errors[:3])}"
                   + (f" (and {len(errors) - 3} other errors)" if len(errors) > 3 else ""))
        if len(failed) == len(run.records):
            raise click.ClickException(message.splitlines()[0])
        click.echo(message, err=True)
