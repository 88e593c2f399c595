"""`/tokenize` and `/detokenize` (vLLM's): text or chat messages to token ids and back."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jaxserve.core.tokenizer import TokenizerError
from jaxserve.core.validation import PromptError, check_token_ids
from jaxserve.server.bodies import offload
from jaxserve.server.context import ServerContext
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import DetokenizeRequest, TokenizeRequest
from jaxserve.server.yielding_json import dumps_ints


def token_routes(ctx: ServerContext) -> APIRouter:
    """The tokenizer's endpoints of `ctx`'s server."""
    router = APIRouter()
    engine = ctx.engine

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

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req, big = await ctx.parse(request, TokenizeRequest)
        if engine.tokenizer is None:
            raise APIError(400, "This model has no tokenizer", "prompt")
        return await offload(big, tokenized, req)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req, big = await ctx.parse(request, DetokenizeRequest)
        if engine.tokenizer is None:
            raise APIError(400, "This model has no tokenizer", "tokens")
        return {"prompt": await offload(big, text_of, req)}

    return router
