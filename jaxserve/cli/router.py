"""`jaxserve router`: the OpenAI API in front of several servers (sglang-router's flags). No jax is loaded."""

from __future__ import annotations

import logging
from typing import Any

import click
import uvicorn

from jaxserve.router.app import RouterConfig, build_router_app
from jaxserve.router.workers import Policy

URL_LISTS = ("--worker-urls", "--prefill", "--decode")


class _UrlListCommand(click.Command):
    """Accepts sglang-router's `--worker-urls A B C` (click options take one value: the flag is repeated)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        out, flag = [], None
        for a in args:
            if a in URL_LISTS:
                flag = a
            elif a.startswith("-"):
                flag = None
            elif flag is not None and out and out[-1] != flag:
                out.append(flag)
            out.append(a)
        return super().parse_args(ctx, out)


@click.command("router", cls=_UrlListCommand)
@click.option("--worker-urls", multiple=True, help="Plain replicas (jaxserve serve): base URLs, each once or "
                                                   "several after one flag.")
@click.option("--pd-disaggregation", is_flag=True, help="Route to prefill and decode servers (--prefill, --decode).")
@click.option("--prefill", "prefill_urls", multiple=True, help="A prefill server's base URL (repeat).")
@click.option("--decode", "decode_urls", multiple=True, help="A decode server's base URL (repeat).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=30000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--cache-threshold", default=0.5, show_default=True, type=click.FloatRange(0, 1),
              help="Share of a prompt's leading blocks a server must have been sent to be preferred for it.")
@click.option("--balance-abs-threshold", default=32, show_default=True, type=click.IntRange(min=0),
              help="Loads further apart than this (requests in flight) send the request to the idlest server.")
@click.option("--health-check-interval", default=2.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds between health checks of every server.")
@click.option("--health-check-timeout", default=2.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds a health check may take.")
@click.option("--health-failure-threshold", default=2, show_default=True, type=click.IntRange(min=1),
              help="Failed health checks in a row that take a server out.")
@click.option("--stall-timeout", default=60.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds a server may send nothing on a response before the request is failed.")
@click.option("--max-attempts", default=3, show_default=True, type=click.IntRange(min=1),
              help="Tries a request gets (on other servers first, then the same again) before it fails.")
@click.option("--retry-initial-backoff-ms", default=50.0, show_default=True, type=click.FloatRange(min=0),
              help="Pause before the servers a request already tried are tried again (1.5x longer each time).")
@click.option("--cb-failure-threshold", default=3, show_default=True, type=click.IntRange(min=1),
              help="Failed requests in a row (no connection, or a break) that take a server out.")
@click.option("--disable-circuit-breaker", is_flag=True,
              help="Failed requests never take a server out (health checks still do).")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
def router(worker_urls: tuple[str, ...], pd_disaggregation: bool, prefill_urls: tuple[str, ...],
           decode_urls: tuple[str, ...], host: str, port: int, cache_threshold: float, balance_abs_threshold: int,
           log_level: str, **checks: Any) -> None:
    """Serve one OpenAI-compatible endpoint in front of several jaxserve servers (docs/disaggregation.md)."""
    def urls(values: tuple[str, ...]) -> tuple[str, ...]:
        out = tuple(u.rstrip("/") for v in values for u in v.replace(",", " ").split())
        bad = [u for u in out if not u.startswith(("http://", "https://"))]
        if bad:
            raise click.UsageError(f"not a base URL (http://host:port): {bad[0]}")
        return out

    try:
        config = RouterConfig(worker_urls=urls(worker_urls), prefill_urls=urls(prefill_urls),
                              decode_urls=urls(decode_urls), pd_disaggregation=pd_disaggregation,
                              policy=Policy(cache_threshold, balance_abs_threshold), **checks)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxserve").setLevel(logging.INFO)
    app = build_router_app(config)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=2,
                loop="uvloop", http="httptools")  # the router's own cost per request is what TTFT sees
