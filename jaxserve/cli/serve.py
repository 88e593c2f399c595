"""`jaxserve serve`: build the engine, serve the OpenAI-compatible app with uvicorn, shut down cleanly.

SIGINT/SIGTERM: uvicorn stops accepting connections, in-flight requests are aborted (a whole response is then
a 503, a stream ends with an error event), the engine loop is stopped, and the process exits 0 within a few
seconds. The flags bounding clients (keys, sizes, waiting, time) are described in docs/server.md; the `vllm
serve` flags taken, renamed or lacking in docs/vllm_flags.md. Heavy imports (jax, uvicorn, the app) happen after
the first log line, inside the command, so `--help` and `jaxserve plan` stay light and a cold start is never
silent.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from typing import Any

import click

import jaxserve
from jaxserve.cli.disagg_flags import check_role, disaggregation_from_options, disaggregation_options
from jaxserve.cli.engine_flags import config_from_options, serving_engine_options
from jaxserve.cli.log_setup import setup_logging
from jaxserve.cli.serve_flags import (
    cors_config,
    engine_overrides,
    limit_options,
    server_limits,
    ssl_files,
    vllm_server_options,
)

logger = logging.getLogger("jaxserve.server")


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine is built: a busy port or an unknown host is one line at
    once, not after a warm-up of up to a minute (uvicorn then serves on this socket)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise click.UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _model_from_tag(ctx: click.Context, tag: str | None, options: dict[str, Any]) -> None:
    """vLLM's positional model (`jaxserve serve tiny`) into --model; both given must agree."""
    if tag is None:
        return
    given = ctx.get_parameter_source("model") == click.core.ParameterSource.COMMANDLINE
    if given and options["model"] != tag:
        raise click.UsageError(f"two models given: {tag} (positional) and --model {options['model']}; give one")
    options["model"] = tag


@click.command("serve")
@click.argument("model_tag", required=False, metavar="[MODEL]")
@serving_engine_options
@limit_options
@vllm_server_options
@disaggregation_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--served-model-name", default=None, help="Model name clients use (default: --model).")
@click.option("--log-interval", default=10.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds between stats log lines.")
@click.option("--uvicorn-log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug", "trace"]))
@click.pass_context
def serve(ctx: click.Context, model_tag: str | None, host: str, port: int, served_model_name: str | None,
          log_interval: float, uvicorn_log_level: str, **options: Any) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (MODEL or --model; default: bard, the trained model that
    ships). `jaxserve serve tiny` works as `vllm serve` does."""
    _model_from_tag(ctx, model_tag, options)
    limits = server_limits(options)
    cors = cors_config(options)
    ssl = ssl_files(options)
    root_path = options.pop("root_path")
    stats_interval = None if options.pop("disable_log_stats") else log_interval
    role = disaggregation_from_options(options)
    config = config_from_options(options, served_model_name=served_model_name, **engine_overrides(options))
    check_role(role, config)
    t0 = time.monotonic()
    # Only process 0 serves; the followers of a multi-host mesh never return from building the engine.
    sock = _listen(host, port) if config.process_id == 0 else None
    setup_logging()
    scheme = "https" if ssl else "http"
    logger.info("jaxserve %s: starting model %s for %s://%s:%d/v1 (loading JAX; a first start on this machine "
                "also builds kernels and compiles, which takes a minute or two)", jaxserve.__version__,
                config.model, scheme, host, port)
    import uvicorn  # after the first log line: these load JAX and the web stack

    from jaxserve.disagg.roles import role_app, role_engine
    from jaxserve.server.transport import tune_interpreter, uvicorn_config

    try:
        engine = role_engine(role, config, host)
    except ValueError as e:  # e.g. an unknown model name or a pool too small for one sequence
        raise click.UsageError(str(e)) from None
    engine.start()
    app = role_app(engine, log_interval=stats_interval, limits=limits, cors=cors)
    tune_interpreter()

    class _Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                bound = [s.getsockname() for srv in self.servers for s in (srv.sockets or [])]
                actual = bound[0][1] if bound else port
                logger.info("jaxserve ready: model %s at %s://%s:%d%s/v1 (max_model_len %d, startup %.1fs)",
                            config.model_name, scheme, host, actual, root_path, engine.max_model_len,
                            time.monotonic() - t0)

        def handle_exit(self, sig: int, frame: Any) -> None:
            # Abort in-flight requests so their streams end now instead of holding the shutdown. Unlike
            # uvicorn's own handler, do not re-raise the signal after shutdown: a clean stop exits 0.
            app.state.generator.abort_all()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    server = _Server(uvicorn_config(app, host, port, limits, log_level=uvicorn_log_level, access_log=False,
                                    timeout_graceful_shutdown=2, lifespan="on", root_path=root_path, **ssl))
    try:
        server.run(sockets=[sock] if sock else None)
    finally:
        engine.shutdown(timeout=2.0)
    if not server.started:
        raise click.ClickException(f"could not start the server on {host}:{port}")
