"""`--api-key`: every route but `/health` needs `Authorization: Bearer <key>` with one of the server's keys.

Deny by default: `/v1/*`, `/tokenize`, `/detokenize`, `/metrics`, `/version`, the docs and unknown paths all
answer 401 without a valid key, so a new route cannot be left open by mistake. Keys are compared as SHA-256
digests with `hmac.compare_digest`, against every key, so the time taken says nothing about any key.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.server.errors import APIError

OPEN_PATHS = frozenset({"/health"})


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class APIKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would buffer streams and hide disconnects)."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self._digests = [_digest(k.encode()) for k in api_keys]

    def authorized(self, header: bytes | None) -> bool:
        """Whether an Authorization header value carries one of the keys."""
        scheme, _, token = (header or b"").partition(b" ")
        given = _digest(token.strip())
        ok = False
        for d in self._digests:  # no early exit: every key is compared
            ok |= hmac.compare_digest(given, d)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if self.authorized(header):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(APIError(401, "Invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                                   None, "invalid_api_key").body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
