"""The OpenAI-compatible HTTP app: `build_app(engine)` assembles the routes, errors, metrics and middleware.

The engine loop runs in its own thread (`engine.start()`); handlers only await its async streams, so HTTP
handling never waits on a jitted step. The routes live by idea: generating (`routes_generate.py`), what the
server says about itself (`routes_info.py`), the tokenizer's (`routes_tokens.py`); errors in OpenAI's shape
(`error_handlers.py`). `ServerLimits` (server/limits.py) bounds what clients may ask; `CORSConfig`
(server/cors.py) what browsers of other origins may do.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

import jaxserve
from jaxserve.server.auth import APIKeyMiddleware
from jaxserve.server.context import ServerContext
from jaxserve.server.cors import CORSConfig, CORSMiddleware
from jaxserve.server.error_handlers import install_error_handlers
from jaxserve.server.limits import ServerLimits
from jaxserve.server.metrics import StatsLogger
from jaxserve.server.openapi import install_openapi
from jaxserve.server.routes_generate import generate_routes
from jaxserve.server.routes_info import info_routes
from jaxserve.server.routes_tokens import token_routes
from jaxserve.server.streaming import install_log_filter


def build_app(engine: Any, log_interval: float | None = 10.0, limits: ServerLimits | None = None,
              cors: CORSConfig | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (already started) under its served model name, within `limits`; a stats
    line every `log_interval` seconds (None: none, vLLM's --disable-log-stats)."""
    ctx = ServerContext.create(engine, limits or ServerLimits())
    install_log_filter()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stats = StatsLogger(engine)

        async def log_loop() -> None:
            while log_interval is not None:
                await asyncio.sleep(log_interval)
                stats.log()

        task = asyncio.create_task(log_loop())
        grammars = asyncio.create_task(ctx.gen.grammars.start())  # the compiler processes, in the background
        try:
            yield
        finally:
            task.cancel()
            grammars.cancel()
            ctx.gen.abort_all()

    app = FastAPI(title="jaxserve", version=jaxserve.__version__, lifespan=lifespan)
    install_openapi(app)
    app.state.generator = ctx.gen
    app.state.metrics = ctx.metrics
    app.state.admission = ctx.admission
    if ctx.limits.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=ctx.limits.api_keys)
    # Added last, so outermost: a browser's preflight is answered before the API-key check.
    app.add_middleware(CORSMiddleware, **(cors or CORSConfig()).middleware_kwargs())
    install_error_handlers(app)
    for router in (generate_routes(ctx), info_routes(ctx), token_routes(ctx)):
        app.include_router(router)
    return app
