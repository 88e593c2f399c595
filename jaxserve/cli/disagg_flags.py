"""`jaxserve serve`'s disaggregation flags (SGLang's `--disaggregation-mode`), onto `DisaggregationConfig`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from jaxserve.config.engine import EngineConfig
from jaxserve.disagg.config import DisaggregationConfig

NAMES = ("disaggregation_mode", "disaggregation_transfer_port", "kv_transfer_timeout", "prefill_urls",
         "disaggregation_chunked_transfer")


def disaggregation_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Add the flags of a prefill or decode server to a click command."""
    d = DisaggregationConfig()
    options = [
        click.option("--disaggregation-mode", type=click.Choice(["null", "prefill", "decode"]), default="null",
                     show_default=True,
                     help="This server's part in disaggregated serving (SGLang's flag): prefill runs prompts and "
                          "offers their KV, decode pulls it and decodes; null is a colocated server. "
                          "See docs/disaggregation.md."),
        click.option("--disaggregation-transfer-port", type=click.IntRange(0, 65535), default=d.transfer_port,
                     show_default=True, help="Port of this server's KV transfer server, on --host (0: any free one)."),
        click.option("--kv-transfer-timeout", type=click.FloatRange(min=0, min_open=True),
                     default=d.kv_transfer_timeout, show_default=True,
                     help="Seconds a prefill server holds a prompt's KV for its pull (then frees it); seconds a "
                          "decode server waits on one prefill server."),
        click.option("--prefill-url", "prefill_urls", multiple=True,
                     help="With --disaggregation-mode decode: a prefill server's base URL, used when the router "
                          "names none (repeat for several, tried in order)."),
        click.option("--disaggregation-chunked-transfer/--no-disaggregation-chunked-transfer",
                     default=d.chunked_transfer, show_default=True,
                     help="With --disaggregation-mode decode: pull each prefill chunk's KV while the next chunks "
                          "compute (off: the whole prompt's KV once it has run)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def disaggregation_from_options(options: dict[str, Any]) -> DisaggregationConfig:
    """Pop the disaggregation flags from `options`; a bad combination is a UsageError."""
    values = {k: options.pop(k) for k in NAMES}
    mode = None if values["disaggregation_mode"] == "null" else values["disaggregation_mode"]
    try:
        return DisaggregationConfig(mode=mode, transfer_port=values["disaggregation_transfer_port"],
                                    kv_transfer_timeout=values["kv_transfer_timeout"],
                                    prefill_urls=tuple(u.rstrip("/") for u in values["prefill_urls"]),
                                    chunked_transfer=values["disaggregation_chunked_transfer"])
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def check_role(role: DisaggregationConfig, config: EngineConfig) -> None:
    """What the role cannot run with, as a UsageError before anything loads."""
    try:
        role.check(config)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
