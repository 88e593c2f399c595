"""The SSE response: ends when its stream ends, when the client disconnects, or when the server cuts it.

A cut (`cut` set: the client stopped reading and the engine ran `--stream-buffer-tokens` ahead) ends the
response at once, even while a send waits on a full socket: the connection is closed and the stream's engine
requests are aborted as the body iterator closes. uvicorn reports a response left incomplete as an error;
for a cut made on purpose that line is dropped (`install_log_filter`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from functools import partial

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

# Set in the task that uvicorn then logs "returned without completing response" from: the cut was ours.
_CUT_ON_PURPOSE: ContextVar[bool] = ContextVar("jaxserve_stream_cut", default=False)
_INCOMPLETE = "ASGI callable returned without completing response"


class _DropPurposefulCut(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (_CUT_ON_PURPOSE.get() and record.getMessage().startswith(_INCOMPLETE))


def install_log_filter() -> None:
    """Once per process: uvicorn's error logger skips its incomplete-response line for streams we cut."""
    log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DropPurposefulCut) for f in log.filters):
        log.addFilter(_DropPurposefulCut())


class SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its generator (so a vanished client aborts the engine requests),
    then calls `on_close`; setting `cut` ends it early."""

    def __init__(self, content: AsyncIterator[str], cut: asyncio.Event, on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.cut = cut
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def until(fn: Callable[[], Awaitable[object]]) -> None:
                    await fn()
                    group.cancel_scope.cancel()

                group.start_soon(until, partial(self.stream_response, send))
                group.start_soon(until, partial(self.listen_for_disconnect, receive))
                group.start_soon(until, self.cut.wait)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.on_close()
        if self.cut.is_set():
            _CUT_ON_PURPOSE.set(True)
