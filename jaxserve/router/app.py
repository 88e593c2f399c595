"""The router's HTTP app: the OpenAI API passed through to servers chosen per request, with its own /health and
/metrics.

Plain replicas (`--worker-urls`): each request goes to one server (`workers.choose`: prefix affinity within load
balance). Disaggregated (`--pd-disaggregation`): each request goes to a decode server (least loaded) with the
prefill servers to use in the `X-Jaxserve-Prefill` header (the cache-aware choice first, the others after it as
fallbacks); the decode server runs the bootstrap with them (jaxserve/disagg/protocol.py).

Failures: a request whose server cannot be reached or breaks the connection before the response's first byte (the
first event of a stream), or answers 503, is tried again, up to `max_attempts` tries in all: on a server not yet
tried, else (every server in rotation tried) on them again after a pause (`retry_initial_backoff_ms`, growing by
half each time). After the first byte a stream that breaks, or sends nothing for `stall_timeout` seconds, ends with
an error event and `[DONE]`; a whole response that fails so is tried again. Each server has a circuit breaker
(sglang-router's): `cb_failure_threshold` failed requests in a row (no connection, or a break) take it out, so
one connection that waits past its timeout on a loaded machine does not take out a healthy server.
Health checks every `health_check_interval` seconds take a server out after `health_failure_threshold` misses and
put it back after one success; a server taken out has its streams ended at once (with the error event) and its
whole responses retried elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxserve.disagg.protocol import PREFILL_HEADER
from jaxserve.router.metrics import render_metrics
from jaxserve.router.workers import Policy, Worker, choose, prefix_blocks, ranked

log = logging.getLogger("jaxserve.router")
HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
               "proxy-authorization", "accept-encoding", PREFILL_HEADER}
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
CONNECT_TIMEOUT_S = 5.0  # a server that has not accepted the connection by then fails this try
BACKOFF_GROWTH = 1.5  # each pause before the servers are tried again is this much longer (sglang-router's)


@dataclass(frozen=True)
class RouterConfig:
    """The router command's flags (sglang-router's names)."""

    worker_urls: tuple[str, ...] = ()
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    pd_disaggregation: bool = False
    policy: Policy = Policy()
    health_check_interval: float = 2.0
    health_check_timeout: float = 2.0
    health_failure_threshold: int = 2
    stall_timeout: float = 60.0  # seconds a response may send nothing before it is failed
    max_attempts: int = 3
    retry_initial_backoff_ms: float = 50.0  # the pause before servers already tried are tried again
    cb_failure_threshold: int = 3  # failed requests in a row that take a server out
    disable_circuit_breaker: bool = False  # failed requests never take a server out (health checks still do)

    def __post_init__(self) -> None:
        if self.pd_disaggregation:
            if not self.prefill_urls or not self.decode_urls:
                raise ValueError("--pd-disaggregation needs at least one --prefill and one --decode URL")
            if self.worker_urls:
                raise ValueError("--worker-urls is for plain replicas, not with --pd-disaggregation")
        elif not self.worker_urls:
            raise ValueError("name the servers: --worker-urls URL... (or --pd-disaggregation --prefill URL... "
                             "--decode URL...)")
        elif self.prefill_urls or self.decode_urls:
            raise ValueError("--prefill/--decode need --pd-disaggregation")


def _error(status: int, message: str, code: str) -> JSONResponse:
    kind = "service_unavailable" if status == 503 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "upstream_failed"}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def prompt_text(payload: dict[str, Any]) -> str:
    """The text a request's prefix affinity is keyed on: the prompt, or the chat messages in order."""
    if "messages" in payload and isinstance(payload["messages"], list):
        return "".join(json.dumps(m, sort_keys=True, separators=(",", ":")) for m in payload["messages"])
    p = payload.get("prompt", "")
    if isinstance(p, list):
        p = p[0] if p and not isinstance(p[0], int) else p
    return p if isinstance(p, str) else json.dumps(p)


class Router:
    """The workers, the upstream client and the health checker of one router app."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.workers = [Worker(u) for u in config.worker_urls]
        self.prefill = [Worker(u, "prefill") for u in config.prefill_urls]
        self.decode = [Worker(u, "decode") for u in config.decode_urls]
        self._client: aiohttp.ClientSession | None = None
        self.counters = {"requests": 0, "retries": 0, "failures": 0}
        self.dead: dict[str, asyncio.Event] = {}

    @property
    def client(self) -> aiohttp.ClientSession:
        """The upstream session (aiohttp: a third of httpx's per-request cost here), made on the serving loop."""
        if self._client is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                            sock_read=self.config.stall_timeout)
            self._client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                                 auto_decompress=False)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def all_workers(self) -> list[Worker]:
        return [*self.workers, *self.prefill, *self.decode]

    def targets(self) -> list[Worker]:
        """The servers requests are sent to: the replicas, or the decode servers."""
        return self.decode if self.config.pd_disaggregation else self.workers

    def death(self, w: Worker) -> asyncio.Event:
        return self.dead.setdefault(w.url, asyncio.Event())

    def fail(self, w: Worker, why: str) -> None:
        if w.healthy:
            log.warning("%s %s taken out: %s", w.role, w.url, why)
        w.mark_dead()
        self.death(w).set()
        for resp in list(w.streams):  # its relays end now, with an error event, instead of at the stall timeout
            resp.close()

    def request_failed(self, w: Worker, why: str) -> None:
        """`w` failed a request (no connection, or a break): one more toward its circuit breaker, which takes it out
        at `cb_failure_threshold` in a row."""
        w.errors += 1
        w.request_failures += 1
        c = self.config
        if not c.disable_circuit_breaker and w.request_failures >= c.cb_failure_threshold:
            self.fail(w, f"{w.request_failures} requests failed in a row, the last: {why}")

    async def check(self, w: Worker) -> None:
        c = self.config
        try:
            async with self.client.get(w.url + "/health",
                                       timeout=aiohttp.ClientTimeout(total=c.health_check_timeout)) as r:
                ok = r.status == 200
        except UPSTREAM_ERRORS:
            ok = False
        if ok:
            if not w.healthy:
                log.warning("%s %s is back", w.role, w.url)
                self.dead[w.url] = asyncio.Event()
            w.healthy, w.failures = True, 0
        else:
            w.failures += 1
            if w.failures >= c.health_failure_threshold:
                self.fail(w, f"{w.failures} health checks failed")

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(w) for w in self.all_workers()))
            await asyncio.sleep(self.config.health_check_interval)

    def pick(self, payload: dict[str, Any], tried: set[str]) -> tuple[Worker | None, Worker | None, dict[str, str]]:
        """The server for this attempt, the prefill server it is told to use first, and the extra headers."""
        blocks = prefix_blocks(prompt_text(payload))
        if not self.config.pd_disaggregation:
            return choose(self.workers, blocks, self.config.policy, tried), None, {}
        prefills = ranked(self.prefill, blocks, self.config.policy)
        if not prefills:
            return None, None, {}
        decode = choose(self.decode, [], self.config.policy, tried)
        return decode, prefills[0], {PREFILL_HEADER: ",".join(w.url for w in prefills)}

    async def forward(self, request: Request, path: str) -> Response:
        """Pass one request through (see module doc)."""
        body = await request.body()
        try:
            payload = json.loads(body) if body else {}
            payload = payload if isinstance(payload, dict) else {}
        except ValueError:
            payload = {}  # the server answers the bad JSON
        stream = bool(payload.get("stream"))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        self.counters["requests"] += 1
        tried: set[str] = set()
        reason = "no healthy server"
        pause = self.config.retry_initial_backoff_ms / 1e3
        for attempt in range(self.config.max_attempts):
            w, prefill, extra = self.pick(payload, tried)
            if w is None and tried and any(x.healthy for x in self.targets()):
                await asyncio.sleep(pause)  # every server in rotation tried: them again, after a pause
                pause *= BACKOFF_GROWTH
                tried.clear()
                w, prefill, extra = self.pick(payload, tried)
            if w is None:
                break
            if prefill is not None:  # busy with this request until its first byte (the prefill's end)
                prefill.load += 1
                prefill.requests += 1
            if attempt:
                self.counters["retries"] += 1
            tried.add(w.url)
            w.load += 1
            w.requests += 1
            resp: aiohttp.ClientResponse | None = None
            try:
                try:
                    resp = await self.client.request(request.method, w.url + path, data=body,
                                                     headers={**headers, **extra}, params=request.query_params)
                finally:
                    if prefill is not None:
                        prefill.load -= 1
                if resp.status == 503 and attempt + 1 < self.config.max_attempts:
                    reason = f"{w.url} answered 503"
                    resp.release()
                    w.load -= 1
                    continue
                if stream and resp.content_type == "text/event-stream":
                    chunks = resp.content.iter_any()
                    first = await anext(chunks, b"")  # before any byte is sent: a failure here is retried
                    w.request_failures = 0
                    return StreamingResponse(self.relay(w, resp, first, chunks), status_code=resp.status,
                                             media_type="text/event-stream",
                                             headers={"cache-control": "no-cache"})
                content = await self.whole(w, resp)
                w.load -= 1
                w.request_failures = 0
                return Response(content, status_code=resp.status,
                                media_type=resp.headers.get("content-type", "application/json"))
            except UPSTREAM_ERRORS as e:
                w.load -= 1
                reason = f"{w.url}: {type(e).__name__}"
                self.request_failed(w, reason)
                if resp is not None:
                    resp.close()
            except _Died:
                w.load -= 1
                w.errors += 1
                reason = f"{w.url} was taken out while it answered"
        self.counters["failures"] += 1
        return _error(503, f"no server could answer this request ({reason})", "no_healthy_upstream")

    async def whole(self, w: Worker, resp: aiohttp.ClientResponse) -> bytes:
        """A whole response's body, failed (`_Died`) if its server is taken out first."""
        read = asyncio.ensure_future(resp.read())
        died = asyncio.ensure_future(self.death(w).wait())
        try:
            await asyncio.wait({read, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
            if not read.done():
                read.cancel()
                with contextlib.suppress(BaseException):
                    await read
                resp.close()
                raise _Died()
        return read.result()

    async def relay(self, w: Worker, resp: aiohttp.ClientResponse, first: bytes,
                    chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A stream's bytes as they come; a break, a stall, or an end without `[DONE]` ends it with an error event."""
        w.streams.add(resp)
        tail = first[-16:]
        try:
            if first:
                yield first
            async for chunk in chunks:
                tail = (tail + chunk)[-16:]
                yield chunk
            if b"[DONE]" not in tail:
                raise aiohttp.ClientPayloadError("the stream ended early")
        except UPSTREAM_ERRORS as e:
            self.counters["failures"] += 1
            if isinstance(e, asyncio.TimeoutError):  # a stall is the health checks' to judge
                w.errors += 1
            else:
                self.request_failed(w, f"stream broke: {type(e).__name__}")
            yield _sse_error(f"the server {w.url} failed mid-stream ({type(e).__name__}); the output is cut")
        finally:
            w.streams.discard(resp)
            w.load -= 1
            resp.close()


class _Died(Exception):
    """The server of an in-flight whole response was taken out."""


def build_router_app(config: RouterConfig) -> FastAPI:
    """The router's app; its health checker runs while the app does."""
    router = Router(config)
    started = time.monotonic()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(router.health_loop())
        try:
            yield
        finally:
            task.cancel()
            await router.close()

    app = FastAPI(title="jaxserve router", lifespan=lifespan)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        groups = [router.prefill, router.decode] if config.pd_disaggregation else [router.workers]
        if all(any(w.healthy for w in g) for g in groups):
            return Response(status_code=200)
        return _error(503, "no healthy server", "no_healthy_upstream")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(router.all_workers(), router.counters, time.monotonic() - started),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def passthrough(request: Request) -> Response:
        return await router.forward(request, request.url.path)

    # A plain Starlette route: no FastAPI parameter solving on the path every request takes.
    app.router.routes.append(Route("/{path:path}", passthrough, methods=["GET", "POST"]))

    return app
