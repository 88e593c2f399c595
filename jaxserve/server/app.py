"""The OpenAI-compatible HTTP app: `build_app(engine)` wires endpoints, errors, metrics and disconnects.

The engine loop runs in its own thread (`engine.start()`); handlers only await its async streams, so HTTP
handling never waits on a jitted step. Every error is answered in OpenAI's shape; a client that goes away,
streaming or not, has its engine requests aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

import jaxserve
from jaxserve.core.validation import PromptError, check_token_ids
from jaxserve.server.metrics import ServerMetrics, StatsLogger
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UnsupportedValue,
)
from jaxserve.server.serving import APIError, Generator, new_request_id

logger = logging.getLogger("jaxserve.server")
M = TypeVar("M", bound=BaseModel)
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class _SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its generator, so a vanished client aborts the engine request."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


def _reject_constant(name: str) -> None:
    """NaN and Infinity are not JSON."""
    raise ValueError(f"{name} is not valid JSON")


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """`messages[0].content` from a pydantic error location, dropping union-member tags."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part.lower() not in _TYPE_TAGS:
            path += f".{part}" if path else part
        else:
            break
    return path or None


def validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming the first offending parameter."""
    err = e.errors()[0]
    loc = tuple(err.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    param = _param_path(loc)
    if err["type"] == "extra_forbidden":
        return APIError(400, f"Unsupported parameter: '{param}' (jaxserve does not implement it)", param,
                        "unsupported_parameter")
    if err["type"] == "missing":
        return APIError(400, f"Missing required parameter: '{param}'", param, "missing_required_parameter")
    what = f"'{param}'" if param else "request"
    return APIError(400, f"Invalid {what}: {err['msg']}", param, "invalid_value")


def build_app(engine: Any, log_interval: float = 10.0) -> FastAPI:
    """The FastAPI app serving `engine` (already started) under its served model name."""
    model_name: str = engine.config.model_name
    gen = Generator(engine, model_name)
    metrics = ServerMetrics(engine, model_name)
    engine.add_observer(metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stats = StatsLogger(engine)

        async def log_loop() -> None:
            while True:
                await asyncio.sleep(log_interval)
                stats.log()

        task = asyncio.create_task(log_loop())
        try:
            yield
        finally:
            task.cancel()
            gen.abort_all()

    app = FastAPI(title="jaxserve", version=jaxserve.__version__, lifespan=lifespan)
    app.state.generator = gen
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_error(e)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        err = APIError(e.status_code, str(e.detail), code=None)
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return JSONResponse(APIError(500, f"Internal error: {e!r}").body(), status_code=500)

    async def parse(request: Request, cls: type[M]) -> M:
        """Read and validate a JSON body; any problem is a 400 (404 for another model's name)."""
        body = await request.body()
        try:
            obj = json.loads(body, parse_constant=_reject_constant)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            raise APIError(400, f"Malformed JSON body: {e}", None, "invalid_json") from None
        if not isinstance(obj, dict):
            raise APIError(400, "The request body must be a JSON object", None, "invalid_type")
        try:
            req = cls.model_validate(obj)
        except ValidationError as e:
            raise validation_error(e) from None
        name = getattr(req, "model", None)
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        return req

    def check_values(req: CompletionRequest | ChatCompletionRequest) -> None:
        try:
            req.validate_values()
        except UnsupportedValue as e:
            raise APIError(400, str(e), e.param, e.code) from None
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(" ")[0], "invalid_value") from None
        if not engine.is_healthy:
            raise APIError(503, "The engine is not running", type_="service_unavailable")

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
            raise APIError(500, f"Internal error: {e!r}") from None
        return JSONResponse(result.model_dump(mode="json"))

    async def generate(request: Request, model: type, prefix: str, make_subs, respond, chat: bool) -> Response:
        """The shared body of the completions and chat endpoints: validate, submit, stream or answer."""
        req = await parse(request, model)
        check_values(req)
        req_id = new_request_id(prefix)
        subs = make_subs(req_id, req)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(gen.stream(req_id, subs, chat, usage), media_type="text/event-stream")

        async def work() -> BaseModel:
            await gen.run(subs)
            return respond(req_id, subs)

        return await answer(request, work)

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
        return {"version": jaxserve.__version__}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await parse(request, TokenizeRequest)
        if engine.tokenizer is None:
            raise APIError(400, "This model has no tokenizer", "prompt")
        if req.messages is not None:
            msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
            text = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt)
            tokens = list(engine.tokenizer.encode(text, add_special_tokens=False))
        else:
            tokens = list(engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await parse(request, DetokenizeRequest)
        if engine.tokenizer is None:
            raise APIError(400, "This model has no tokenizer", "tokens")
        try:
            check_token_ids(req.tokens, engine.spec.vocab_size)
        except PromptError as e:
            raise APIError(400, str(e), "tokens", e.code) from None
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    return app
