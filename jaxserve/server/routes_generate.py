"""`/v1/completions` and `/v1/chat/completions`: validate, admit, tokenize, then stream or answer whole.

A client that goes away, streaming or not, has its engine requests aborted, quietly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from jaxserve.server.bodies import offload
from jaxserve.server.context import ServerContext
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedValue
from jaxserve.server.serving import new_request_id
from jaxserve.server.streaming import SSEResponse

logger = logging.getLogger("jaxserve.server")
MANY_TOOLS = 8  # past this many tools, their grammar (fitted to max_tokens) is built off the event loop


def check_values(ctx: ServerContext, req: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for values the engine cannot take (logprobs past --max-logprobs too); 503 when it cannot run."""
    try:
        req.validate_values()
    except UnsupportedValue as e:
        raise APIError(400, str(e), e.param, e.code) from None
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ")[0], "invalid_value") from None
    most = ctx.limits.max_logprobs
    asked = {"logprobs": req.logprobs if isinstance(req, CompletionRequest) else None,
             "top_logprobs": getattr(req, "top_logprobs", None), "prompt_logprobs": req.prompt_logprobs}
    for name, k in asked.items():
        if isinstance(k, int) and k > most:
            raise APIError(400, f"{name}={k} is more than this server's --max-logprobs {most}", name,
                           "invalid_value")
    if not ctx.engine.is_healthy:
        raise APIError(503, "The engine is not running", type_="service_unavailable")
    if ctx.gen.closing:
        raise APIError(503, "The server is shutting down", None, "server_shutdown", type_="service_unavailable")


def num_sequences(req: CompletionRequest | ChatCompletionRequest) -> int:
    """Engine sequences the request becomes: prompts x n."""
    if isinstance(req, ChatCompletionRequest):
        return req.n
    try:
        return len(req.prompts()) * req.n
    except UnsupportedValue as e:
        raise APIError(400, str(e), e.param, e.code) from None


async def answer(request: Request, work: Callable[[], Awaitable[BaseModel]]) -> Response:
    """Run a whole-response request; abort it if the client disconnects first."""
    task = asyncio.ensure_future(work())

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        return Response(status_code=499)
    try:
        result = task.result()
    except APIError:
        raise
    except Exception as e:
        logger.exception("request failed")
        raise APIError(500, f"Internal error ({type(e).__name__})") from None
    return JSONResponse(result.model_dump(mode="json"))


async def generate(ctx: ServerContext, request: Request, model: type, prefix: str, make_subs, respond,
                   chat: bool) -> Response:
    """The shared body of the completions and chat endpoints: validate, admit, tokenize, stream or answer."""
    loop = asyncio.get_running_loop()
    limits, gen = ctx.limits, ctx.gen
    deadline = None if limits.request_timeout is None else loop.time() + limits.request_timeout
    req, big = await ctx.parse(request, model, ctx.shape_check)
    check_values(ctx, req)
    release: Callable[[], None] | None = ctx.admission.reserve(num_sequences(req))
    try:
        req_id = new_request_id(prefix)
        many_tools = len(getattr(req, "tools", None) or ()) > MANY_TOOLS
        subs = await offload(big or many_tools, make_subs, req_id, req)
        if subs:
            ctx.metrics.on_request_params(req.n, subs[0].params.max_tokens or 0)
        await gen.compile_constraints(subs, req)
        if req.stream:
            opts = req.stream_options
            usage = bool(opts and opts.include_usage)
            continuous = usage and bool(opts and opts.continuous_usage_stats)
            cut = asyncio.Event()
            response = SSEResponse(gen.stream(req_id, subs, chat, usage, deadline, cut, continuous), cut, release)
            release = None  # the response releases its sequences when it ends
            return response

        async def work() -> BaseModel:
            await gen.run(subs, deadline)
            return respond(req_id, subs)

        return await answer(request, work)
    finally:
        if release is not None:
            release()


def generate_routes(ctx: ServerContext) -> APIRouter:
    """The two generating endpoints of `ctx`'s server."""
    router = APIRouter()
    gen = ctx.gen

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(ctx, request, CompletionRequest, "cmpl", gen.completion_subs, gen.completion_response,
                              chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(ctx, request, ChatCompletionRequest, "chatcmpl", gen.chat_subs, gen.chat_response,
                              chat=True)

    return router
