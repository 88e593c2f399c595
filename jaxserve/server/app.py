"""The OpenAI-compatible HTTP app: `build_app(engine)` wires endpoints, errors, metrics and disconnects.

The engine loop runs in its own thread (`engine.start()`); handlers only await its async streams, so HTTP
handling never waits on a jitted step. Every error is answered in OpenAI's shape; a client that goes away,
streaming or not, has its engine requests aborted, quietly. `ServerLimits` (server/limits.py) bounds what
clients may ask: API keys, body size, prompts per request, waiting sequences, time, stream buffering.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from functools import partial
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import jaxserve
from jaxserve.core.tokenizer import TokenizerError
from jaxserve.core.validation import PromptError, check_token_ids
from jaxserve.server.auth import APIKeyMiddleware
from jaxserve.server.bodies import OFFLOAD_BYTES, decode, offload, read_body
from jaxserve.server.errors import APIError, excerpt, validation_error
from jaxserve.server.limits import Admission, ServerLimits, check_request_shape
from jaxserve.server.metrics import ServerMetrics, StatsLogger
from jaxserve.server.openapi import install_openapi
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    UnsupportedValue,
    ignored_fields,
)
from jaxserve.server.responses import ModelCard, ModelList
from jaxserve.server.serving import Generator, new_request_id
from jaxserve.server.streaming import SSEResponse, install_log_filter
from jaxserve.server.token_text import tokenizer_info
from jaxserve.server.yielding_json import dumps_ints

logger = logging.getLogger("jaxserve.server")
M = TypeVar("M", bound=BaseModel)


def build_app(engine: Any, log_interval: float = 10.0, limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (already started) under its served model name, within `limits`."""
    limits = limits or ServerLimits()
    model_name: str = engine.config.model_name
    gen = Generator(engine, model_name, limits)
    metrics = ServerMetrics(engine, model_name)
    engine.add_observer(metrics)
    waiting = None if limits.max_num_waiting is None else engine.config.max_num_seqs + limits.max_num_waiting
    admission = Admission(waiting)
    shape = partial(check_request_shape, limits=limits, max_model_len=engine.max_model_len)
    install_log_filter()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stats = StatsLogger(engine)

        async def log_loop() -> None:
            while True:
                await asyncio.sleep(log_interval)
                stats.log()

        task = asyncio.create_task(log_loop())
        grammars = asyncio.create_task(gen.grammars.start())  # the compiler processes, in the background
        try:
            yield
        finally:
            task.cancel()
            grammars.cancel()
            gen.abort_all()

    app = FastAPI(title="jaxserve", version=jaxserve.__version__, lifespan=lifespan)
    install_openapi(app)
    app.state.generator = gen
    app.state.metrics = metrics
    app.state.admission = admission
    if limits.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=limits.api_keys)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody reads it; not an error of ours, so nothing is logged

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_error(e)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        err = APIError(e.status_code, excerpt(str(e.detail), 200), code=None)
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return JSONResponse(APIError(500, f"Internal error ({type(e).__name__})").body(), status_code=500)

    async def parse(request: Request, cls: type[M], precheck: Callable[[dict[str, Any]], None] | None = None,
                    ) -> tuple[M, bool]:
        """Read and validate a JSON body (off the event loop when big); returns it and whether it was big.
        415, 413, 400 for a bad body; 404 for another model's name."""
        body = await read_body(request, limits.max_request_body_bytes)
        big = len(body) >= OFFLOAD_BYTES
        req = await offload(big, decode, body, cls, precheck)
        ignored = ignored_fields(req)
        if ignored:  # vLLM's behaviour: accepted, and the names logged so a misspelt parameter can be found
            logger.warning("The following fields were present in the request but ignored: %s",
                           ", ".join(excerpt(n, 40) for n in ignored))
        name = getattr(req, "model", None)
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{excerpt(name)}` does not exist.", "model", "model_not_found")
        return req, big

    def check_values(req: CompletionRequest | ChatCompletionRequest) -> None:
        try:
            req.validate_values()
        except UnsupportedValue as e:
            raise APIError(400, str(e), e.param, e.code) from None
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(" ")[0], "invalid_value") from None
        if not engine.is_healthy:
            raise APIError(503, "The engine is not running", type_="service_unavailable")
        if gen.closing:
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

    async def generate(request: Request, model: type, prefix: str, make_subs, respond, chat: bool) -> Response:
        """The shared body of the completions and chat endpoints: validate, admit, tokenize, stream or answer."""
        loop = asyncio.get_running_loop()
        deadline = None if limits.request_timeout is None else loop.time() + limits.request_timeout
        req, big = await parse(request, model, shape)
        check_values(req)
        release: Callable[[], None] | None = admission.reserve(num_sequences(req))
        try:
            req_id = new_request_id(prefix)
            many_tools = len(getattr(req, "tools", None) or ()) > 8  # their grammar is fitted to max_tokens
            subs = await offload(big or many_tools, make_subs, req_id, req)
            await gen.compile_constraints(subs, req)
            if req.stream:
                opts = req.stream_options
                usage = bool(opts and opts.include_usage)
                continuous = usage and bool(opts and opts.continuous_usage_stats)
                cut = asyncio.Event()
                response = SSEResponse(gen.stream(req_id, subs, chat, usage, deadline, cut, continuous), cut,
                                       release)
                release = None  # the response releases its sequences when it ends
                return response

            async def work() -> BaseModel:
                await gen.run(subs, deadline)
                return respond(req_id, subs)

            return await answer(request, work)
        finally:
            if release is not None:
                release()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest, "cmpl", gen.completion_subs, gen.completion_response,
                              chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest, "chatcmpl", gen.chat_subs, gen.chat_response,
                              chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=model_name, root=engine.config.model, max_model_len=engine.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, f"The model `{excerpt(model_id)}` does not exist.", "model", "model_not_found")
        return ModelCard(id=model_name, root=engine.config.model, max_model_len=engine.max_model_len).model_dump()

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        return JSONResponse(APIError(503, "The engine loop has died", type_="service_unavailable").body(),
                            status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> dict[str, str]:
        c = engine.config
        return {"version": jaxserve.__version__, "attention_backend": c.attention_backend,
                "quantization": c.quantization or "none", "kv_cache_dtype": c.kv_cache_dtype}

    @app.get("/tokenizer_info")
    async def tokenizer() -> dict[str, Any]:
        if engine.tokenizer is None:
            raise APIError(400, "This model has no tokenizer", None)
        return tokenizer_info(engine.tokenizer, engine.max_model_len, engine.spec.vocab_size).model_dump()

    def tokens_of(req: TokenizeRequest) -> list[int]:
        tok = engine.tokenizer
        try:
            if req.messages is not None:
                msgs = [m.template_dict() for m in req.messages]
                text = tok.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt)
                return list(tok.encode(text, add_special_tokens=False))
            return list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        except TokenizerError as e:
            raise APIError(400, str(e), "messages") from None
        except UnicodeError:
            raise APIError(400, "The text is not valid Unicode (it holds a lone surrogate)", None,
                           "invalid_value") from None

    def text_of(req: DetokenizeRequest) -> str:
        try:
            check_token_ids(req.tokens, engine.spec.vocab_size)
        except PromptError as e:
            raise APIError(400, str(e), "tokens", e.code) from None
        return engine.tokenizer.decode(req.tokens, skip_special_tokens=False)

    def tokenized(req: TokenizeRequest) -> Response:
        """Rendered here, in slices (FastAPI would walk the list on the event loop, json.dumps in one piece)."""
        tokens = tokens_of(req)
        body = f'{{"count":{len(tokens)},"max_model_len":{engine.max_model_len},"tokens":{dumps_ints(tokens)}}}'
        return Response(body, media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req, big = await parse(request, TokenizeRequest)
        if engine.tokenizer is None:
            raise APIError(400, "This model has no tokenizer", "prompt")
        return await offload(big, tokenized, req)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req, big = await parse(request, DetokenizeRequest)
        if engine.tokenizer is None:
            raise APIError(400, "This model has no tokenizer", "tokens")
        return {"prompt": await offload(big, text_of, req)}

    return app
