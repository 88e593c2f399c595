"""`jaxserve generate`: one completion from the engine, streamed to the terminal."""

from __future__ import annotations

import click

from jaxserve.cli.engine_flags import build_engine, config_from_options, serving_engine_options
from jaxserve.core.sampling_params import SamplingParams


def _visible(text: str) -> bool:
    """Whether a terminal shows something of `text` (not only spaces, control bytes or U+FFFD)."""
    return any(ch.isprintable() and not ch.isspace() and ch != "\ufffd" for ch in text)


@click.command()
@serving_engine_options
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
    if out is not None and out.token_ids and not _visible(out.text) and engine.tokenizer is not None:
        # e.g. a synthetic model's random bytes: say what came out rather than print an empty line
        click.echo(f"(no visible text: token ids {', '.join(map(str, out.token_ids[:32]))}"
                   + (", ...)" if len(out.token_ids) > 32 else ")"))
    if out is not None and out.metrics.ttft is not None:
        m = out.metrics
        tpot = f", TPOT {m.tpot * 1e3:.1f} ms" if m.tpot is not None else ""
        click.echo(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
                   f"TTFT {m.ttft * 1e3:.1f} ms{tpot}]", err=True)
