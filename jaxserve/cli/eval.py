"""`jaxserve eval`: model quality through the engine; `jaxserve eval perplexity`."""

from __future__ import annotations

import json

import click

from jaxserve.cli.engine_flags import build_engine, config_from_options, serving_engine_options
from jaxserve.measure.eval.perplexity import perplexity
from jaxserve.measure.eval.windows import HELD_OUT, read_eval_text


@click.group("eval")
def eval_group() -> None:
    """Evaluate a model through the engine (perplexity over a text)."""


@eval_group.command("perplexity")
@serving_engine_options
@click.option("--data", default=HELD_OUT, show_default=True,
              help="held-out (the text shipped beside a trained model such as bard) or a UTF-8 text file.")
@click.option("--max-len", default=None, type=click.IntRange(min=2),
              help="Tokens per window (default: the context length minus one, at most 512).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def perplexity_command(data: str, max_len: int | None, as_json: bool, **options) -> None:
    """Perplexity of --model over --data, from the engine's prompt logprobs, in non-overlapping windows."""
    config = config_from_options(options)
    try:
        text = read_eval_text(config.model, data)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    engine = build_engine(config, announce=False)
    if engine.tokenizer is None:
        raise click.UsageError(f"model {config.model!r} has no tokenizer to turn the text into tokens")
    limit = engine.max_model_len - 1  # the window plus the one token each request draws
    if max_len is not None and max_len > limit:
        raise click.UsageError(f"--max-len {max_len} exceeds what the context holds ({limit})")
    max_len = max_len or min(512, limit)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    try:
        result = perplexity(engine, ids, max_len)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps({"model": config.model, "data": data, **result.as_dict()}))
        return
    click.echo(f"{config.model} on {data}: perplexity {result.perplexity:.3f} (mean NLL {result.nll:.4f} nats "
               f"over {result.num_tokens} tokens, {result.num_windows} windows of up to {result.max_len})")
