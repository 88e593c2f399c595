"""uvicorn as jaxserve runs it: h11 with a deadline on receiving each request.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`) but not a request being received: a
client that opens a connection and sends nothing, half its headers or half its body holds the connection
(and, mid-body, a handler) forever. Here each request must arrive whole within `request_read_timeout` of
the connection opening or of the previous response ending; past that the client gets a 408 and the
connection is closed. `tune_interpreter` holds the interpreter settings the serving process runs with.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxserve.server.errors import APIError
from jaxserve.server.limits import ServerLimits

SWITCH_INTERVAL_S = 0.001  # Python's default is 0.005


def tune_interpreter() -> None:
    """Process-wide, once the engine and app are built: a thread running Python (the engine's host code, the
    decode pool) hands the GIL to a waiting event loop after 1 ms instead of 5; and every object that exists
    now (JAX's, the model's: millions) is frozen out of the garbage collector, whose full passes over them
    otherwise stop every thread for a long pause under load (docs/server.md; tests/test_server_hostile_clients.py)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    gc.freeze()


def _timeout_response() -> bytes:
    body = json.dumps(APIError(408, "The request was not received in time", None, "request_timeout").body())
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body.encode()))


class ReadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus the request read deadline (`read_timeout` seconds; set by a subclass)."""

    read_timeout: float = 30.0
    _read_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
            self._disarm()  # the request arrived whole (or the connection is over)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if self.cycle is not None and not self.cycle.response_complete else None
        if cycle is None or not cycle.response_started:
            self.transport.write(_timeout_response())
        if cycle is not None:  # a handler waits on the body: it sees a disconnect, and its sends are dropped
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def uvicorn_config(app: Any, host: str, port: int, limits: ServerLimits, **kwargs: Any) -> uvicorn.Config:
    """The uvicorn config for `app`: the read-deadline protocol, plus any other uvicorn settings in `kwargs`."""
    protocol = type("ReadTimeoutH11", (ReadTimeoutH11Protocol,), {"read_timeout": limits.request_read_timeout})
    return uvicorn.Config(app, host=host, port=port, http=protocol, **kwargs)
