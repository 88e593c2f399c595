"""What the server says about itself: `/v1/models`, `/health`, `/metrics`, `/version`, `/tokenizer_info`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

import jaxserve
from jaxserve.server.context import ServerContext
from jaxserve.server.errors import APIError
from jaxserve.server.responses import ModelCard, ModelList
from jaxserve.server.token_text import tokenizer_info


def info_routes(ctx: ServerContext) -> APIRouter:
    """The read-only endpoints of `ctx`'s server."""
    router = APIRouter()
    engine = ctx.engine

    def card() -> ModelCard:
        return ModelCard(id=ctx.model_name, root=engine.config.model, max_model_len=engine.max_model_len)

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[card()]).model_dump()

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != ctx.model_name:
            raise ctx.unknown_model(model_id)
        return card().model_dump()

    @router.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        return JSONResponse(APIError(503, "The engine loop has died", type_="service_unavailable").body(),
                            status_code=503)

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.get("/version")
    async def version() -> dict[str, str]:
        c = engine.config
        return {"version": jaxserve.__version__, "attention_backend": c.attention_backend,
                "quantization": c.quantization or "none", "kv_cache_dtype": c.kv_cache_dtype}

    @router.get("/tokenizer_info")
    async def tokenizer() -> dict[str, Any]:
        if engine.tokenizer is None:
            raise APIError(400, "This model has no tokenizer", None)
        return tokenizer_info(engine.tokenizer, engine.max_model_len, engine.spec.vocab_size).model_dump()

    return router
