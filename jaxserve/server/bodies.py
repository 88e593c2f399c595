"""Request bodies: only `application/json` (415), at most `max_request_body_bytes` (413, refused from the
Content-Length header before anything is read, or as soon as a chunked upload passes the bound), and
decoded into a pydantic model with every failure a one-line 400.

Bodies of `OFFLOAD_BYTES` or more are decoded, validated and tokenized on a small worker pool instead of the
event loop, JSON parsed in slices (server/yielding_json.py): that work yields the GIL every few milliseconds,
so `/health` and the other streams keep being served. What still holds the GIL in one piece (pydantic over a
prompt of ids, a tokenizer's encode) is bounded by the body-size limit and the context length.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from jaxserve.core.json_depth import json_depth
from jaxserve.server import yielding_json
from jaxserve.server.errors import APIError, validation_error

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
OFFLOAD_BYTES = 32 * 2**10  # below this, a thread hop costs more than the work it would move
MAX_BODY_DEPTH = 128  # nesting of a whole body, measured before anything recursive (json, pydantic) walks it
MAX_IGNORED_DEPTH = 64  # nesting allowed in the fields a request holds but jaxserve ignores
_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxserve-decode")
CLOSE = {"Connection": "close"}  # the body was left unread: the connection cannot carry another request


async def offload(big: bool, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` here when not `big`, else on the decode pool while the event loop goes on serving."""
    if not big:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_POOL, partial(fn, *args))


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes", None,
                    "request_too_large", headers=CLOSE)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body of a JSON request; 415 for another content type, 413 past `limit` bytes.

    Raises starlette's ClientDisconnect when the client goes away mid-upload (the app answers it quietly).
    """
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        shown = f"'{media[:60]}'" if media else "none"
        raise APIError(415, f"The request body must be JSON, sent with 'Content-Type: application/json' "
                            f"(got {shown})", None, "unsupported_media_type", headers=CLOSE)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def decode(body: bytes, cls: type[M], precheck: Callable[[dict[str, Any]], None] | None = None) -> M:
    """Parse and validate a JSON object body as `cls`; every problem is a 400. `precheck` sees the raw object
    first (cheap bounds before pydantic walks it). A big body is parsed in slices, and any body nested deeper
    than MAX_BODY_DEPTH is refused before it is parsed."""
    depth = json_depth(body)
    if depth > MAX_BODY_DEPTH:
        raise APIError(400, f"Malformed JSON body: nested {depth} deep, past this server's limit of "
                            f"{MAX_BODY_DEPTH}", None, "invalid_json")
    try:
        if len(body) >= OFFLOAD_BYTES:
            obj = yielding_json.loads(body)
        else:
            obj = json.loads(body, parse_constant=yielding_json.reject_constant)
    except RecursionError:
        raise APIError(400, "Malformed JSON body: nested too deeply", None, "invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"Malformed JSON body: {e}", None, "invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, "The request body must be a JSON object", None, "invalid_type")
    if precheck is not None:
        precheck(obj)
    try:
        req = cls.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:  # a nested free-form field (tools, response_format) pydantic walks recursively
        raise APIError(400, "Malformed JSON body: nested too deeply", None, "invalid_json") from None
    if _depth(req.model_extra or {}) > MAX_IGNORED_DEPTH:  # ignored fields are kept, so they are bounded too
        raise APIError(400, "Malformed JSON body: nested too deeply", None, "invalid_json")
    return req


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest
