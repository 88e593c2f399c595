"""`jaxserve serve`: build the engine, serve the OpenAI-compatible app with uvicorn, shut down cleanly.

SIGINT/SIGTERM: uvicorn stops accepting connections, in-flight requests are aborted (a whole response is then
a 503, a stream ends with an error event), the engine loop is stopped, and the process exits 0 within a few
seconds. The flags bounding clients (keys, sizes, waiting, time) are described in docs/server.md.
Heavy imports (jax, fastapi, uvicorn) happen inside the command so `jaxserve plan` stays light.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from typing import Any

import click
import uvicorn

from jaxserve.cli.disagg_flags import disaggregation_from_options, disaggregation_options
from jaxserve.cli.engine_flags import config_from_options, parse_bytes, serving_engine_options
from jaxserve.server.limits import ServerLimits
from jaxserve.server.transport import tune_interpreter, uvicorn_config

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


class _Size(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        return value if isinstance(value, int) else parse_bytes(str(value))


def _limit_options(f: Any) -> Any:
    """Server-only flags: vLLM's names where vLLM has the flag, TGI-style names otherwise."""
    d = ServerLimits()
    options = [
        click.option("--api-key", "api_keys", multiple=True, envvar="JAXSERVE_API_KEY",
                     help="Require 'Authorization: Bearer KEY' on every route but /health (vLLM's flag). Repeat for "
                          "several keys; default from $JAXSERVE_API_KEY (several separated by spaces)."),
        click.option("--max-request-body-bytes", type=_Size(), default=d.max_request_body_bytes, show_default=True,
                     help="Largest request body (413 past it; TGI's --payload-limit)."),
        click.option("--max-prompts-per-request", type=click.IntRange(min=1), default=d.max_prompts_per_request,
                     show_default=True, help="Most engine sequences (prompts x n) one request may ask for (400)."),
        click.option("--max-num-waiting", type=click.IntRange(min=0), default=d.max_num_waiting, show_default=True,
                     help="Sequences admitted beyond --max-num-seqs before new requests get 429 with Retry-After "
                          "(TGI-style, as its --max-concurrent-requests)."),
        click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Seconds a request may take from arrival to its last token (504 past it); default none."),
        click.option("--stream-buffer-tokens", type=click.IntRange(min=0), default=d.stream_buffer_tokens,
                     show_default=True, help="Tokens the engine may run ahead of a stream's reader before the request "
                                             "is aborted and its connection closed (0: no bound)."),
        click.option("--request-read-timeout", type=click.FloatRange(min=0, min_open=True),
                     default=d.request_read_timeout, show_default=True,
                     help="Seconds a client has to send a request's headers and body (408 and close past it)."),
        click.option("--structured-outputs-cache-bytes", type=_Size(), default=d.structured_outputs_cache_bytes,
                     show_default=True, help="Memory the compiled grammars of structured outputs and tool calls may "
                                             "hold (an LRU, by bytes); one grammar may take a quarter of it (400 "
                                             "past that)."),
        click.option("--structured-outputs-compile-timeout", type=click.FloatRange(min=0, min_open=True),
                     default=d.structured_outputs_compile_timeout, show_default=True,
                     help="Seconds one grammar may take to compile, in a worker process (400 past it)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@click.command("serve")
@serving_engine_options
@_limit_options
@disaggregation_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--served-model-name", default=None, help="Model name clients use (default: --model).")
@click.option("--log-interval", default=10.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds between stats log lines.")
@click.option("--uvicorn-log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug", "trace"]))
def serve(host: str, port: int, served_model_name: str | None, log_interval: float, uvicorn_log_level: str,
          **options: Any) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (with no --model: bard, the trained model that ships)."""
    names = ("api_keys", "max_request_body_bytes", "max_prompts_per_request", "max_num_waiting", "request_timeout",
             "stream_buffer_tokens", "request_read_timeout", "structured_outputs_cache_bytes",
             "structured_outputs_compile_timeout")
    try:
        limits = ServerLimits(**{k: options.pop(k) for k in names})
    except ValueError as e:  # e.g. an empty --api-key
        raise click.UsageError(str(e)) from None
    role = disaggregation_from_options(options)
    config = config_from_options(options, served_model_name=served_model_name)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxserve").setLevel(logging.INFO)

    t0 = time.monotonic()
    # Only process 0 serves; the followers of a multi-host mesh never return from building the engine.
    sock = _listen(host, port) if config.process_id == 0 else None
    try:
        engine = role.engine(config, host)
    except ValueError as e:  # e.g. an unknown model name or a pool too small for one sequence
        raise click.UsageError(str(e)) from None
    engine.start()
    app = role.app(engine, log_interval=log_interval, limits=limits)
    tune_interpreter()

    class _Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                bound = [s.getsockname() for srv in self.servers for s in (srv.sockets or [])]
                actual = bound[0][1] if bound else port
                logger.info("jaxserve ready: model %s at http://%s:%d/v1 (max_model_len %d, startup %.1fs)",
                            config.model_name, host, actual, engine.max_model_len, time.monotonic() - t0)

        def handle_exit(self, sig: int, frame: Any) -> None:
            # Abort in-flight requests so their streams end now instead of holding the shutdown. Unlike
            # uvicorn's own handler, do not re-raise the signal after shutdown: a clean stop exits 0.
            app.state.generator.abort_all()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    server = _Server(uvicorn_config(app, host, port, limits, log_level=uvicorn_log_level, access_log=False,
                                    timeout_graceful_shutdown=2, lifespan="on"))
    try:
        server.run(sockets=[sock] if sock else None)
    finally:
        engine.shutdown(timeout=2.0)
    if not server.started:
        raise click.ClickException(f"could not start the server on {host}:{port}")
