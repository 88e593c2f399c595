"""The served OpenAPI schema: the endpoints read their bodies themselves (size caps, off-loop parsing), so FastAPI
cannot see them; `install_openapi` documents each request body and its true response types instead."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from jaxserve.server.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    TokenizerInfo,
    VersionInfo,
)

_REF = "#/components/schemas/{model}"
# path -> (request body model or None, JSON response model, SSE chunk model or None)
_ROUTES: dict[str, tuple[type[BaseModel] | None, type[BaseModel], type[BaseModel] | None]] = {
    "/v1/completions": (CompletionRequest, CompletionResponse, CompletionChunk),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk),
    "/v1/models": (None, ModelList, None),
    "/v1/models/{model_id}": (None, ModelCard, None),
    "/tokenize": (TokenizeRequest, TokenizeResponse, None),
    "/detokenize": (DetokenizeRequest, DetokenizeResponse, None),
    "/tokenizer_info": (None, TokenizerInfo, None),
    "/version": (None, VersionInfo, None),
}
_TEXT = {"/health": "empty on success; an error body (JSON) with 503 when the engine loop has died",
         "/metrics": "Prometheus text exposition format"}


def _schema(model: type[BaseModel], components: dict[str, Any], mode: str) -> dict[str, Any]:
    """A $ref to `model`'s schema, which is added to `components` with every model it refers to."""
    schema = model.model_json_schema(ref_template=_REF, mode=mode)  # type: ignore[arg-type]
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def _json(ref: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": ref}}


def build_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema with request bodies, JSON/SSE responses, errors and plain-text endpoints filled in."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    error = _schema(ErrorResponse, components, "serialization")
    for path, item in doc.get("paths", {}).items():
        for op in item.values():
            op.setdefault("responses", {}).pop("422", None)  # validation errors are 400s in OpenAI's shape
            if path in _TEXT:
                op["responses"]["200"] = {"description": _TEXT[path],
                                          "content": {"text/plain": {"schema": {"type": "string"}}}}
                continue
            if path not in _ROUTES:
                continue
            body, response, chunk = _ROUTES[path]
            if body is not None:
                op["requestBody"] = {"required": True, "content": _json(_schema(body, components, "validation"))}
            content = _json(_schema(response, components, "serialization"))
            if chunk is not None:  # `stream: true`: server-sent events, each `data:` a chunk, then [DONE]
                content["text/event-stream"] = {"schema": _schema(chunk, components, "serialization")}
            op["responses"]["200"] = {"description": "Successful Response", "content": content}
            for status in ("400", "404"):
                op["responses"][status] = {"description": "An OpenAI-style error", "content": _json(error)}
    return doc


def install_openapi(app: FastAPI) -> None:
    """Serve `build_schema(app)` at /openapi.json (built once, on first request)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
