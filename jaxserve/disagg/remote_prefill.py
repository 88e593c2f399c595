"""The decode role's client of prefill servers: ask one to run a prompt, then pull the prompt's KV from it.

Prefill servers are tried in the order given (the router's choice first, then the others it named, then this
server's own `--prefill-url`s): a server that cannot be reached, answers 5xx, or whose KV cannot be pulled is
skipped for this request; a 4xx (the prompt is bad there too) is the client's error. When every one fails the
request fails with a 503 naming the last reason; nothing waits longer than `timeout_s` per server.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import jax

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.disagg.kv_import import Arrival
from jaxserve.disagg.protocol import (
    INFO_PATH,
    PREFILL_HEADER,
    PREFILL_PATH,
    KVHandle,
    KVLayout,
    PrefillRequest,
    PrefillResponse,
)
from jaxserve.disagg.transfer import TransferEndpoint
from jaxserve.server.errors import APIError

log = logging.getLogger("jaxserve.disagg")
MAX_ROUTE_URLS = 8

# The prefill servers named by the request being handled (the router's header), read by the engine wrapper.
prefill_route: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("prefill_route", default=())


def parse_route(header: str) -> tuple[str, ...]:
    """Base URLs from the `X-Jaxserve-Prefill` header: http(s) only, at most MAX_ROUTE_URLS, no trailing slash."""
    urls = []
    for part in header.split(",")[:MAX_ROUTE_URLS]:
        url = part.strip().rstrip("/")
        if urlsplit(url).scheme in ("http", "https") and urlsplit(url).hostname:
            urls.append(url)
    return tuple(urls)


class PrefillRouteMiddleware:
    """ASGI middleware: the request's `X-Jaxserve-Prefill` header, parsed, in `prefill_route` while it runs."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            raw = next((v for k, v in scope["headers"] if k == PREFILL_HEADER.encode()), None)
            if raw is not None:
                token = prefill_route.set(parse_route(raw.decode("latin-1")))
                try:
                    return await self.app(scope, receive, send)
                finally:
                    prefill_route.reset(token)
        await self.app(scope, receive, send)


class PrefillUnavailable(Exception):
    """No prefill server could run the prompt."""


class RemotePrefill:
    """Runs prompts on prefill servers and pulls their KV into this process (see module doc)."""

    def __init__(self, layout: KVLayout, endpoint: TransferEndpoint, timeout_s: float, chunked: bool = True) -> None:
        self.layout, self.endpoint, self.timeout_s, self.chunked = layout, endpoint, timeout_s, chunked
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._checked: set[str] = set()  # prefill servers whose layout matched
        # Pulls block their thread: their own pool, so they never starve asyncio.to_thread's (or each other much).
        self.pulls = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kv-pull")
        self.counters = {"kv_pulls": 0, "kv_pull_bytes": 0, "kv_pull_seconds": 0.0, "prefill_failures": 0,
                         "prefill_answer_seconds": 0.0, "kv_wait_seconds": 0.0}

    async def _check_layout(self, url: str) -> None:
        if url in self._checked:
            return
        r = await self.client.get(url + INFO_PATH)
        r.raise_for_status()
        theirs = KVLayout.from_json(r.json()["layout"])
        reason = self.layout.mismatch(theirs)
        if reason is not None:
            raise PrefillUnavailable(f"{url} cannot send KV here: {reason}")
        self._checked.add(url)

    async def run(self, urls: tuple[str, ...], request_id: str, ids: list[int], params: SamplingParams,
                  cache_salt: str | None) -> Arrival:
        """Prefill on the first of `urls` that can, pull its KV; raises APIError (400 or 503)."""
        body = PrefillRequest.of(request_id, ids, params, cache_salt, self.chunked).to_json()
        reason = "no prefill server named"
        for url in urls:
            start = time.perf_counter()
            host = urlsplit(url).hostname or "127.0.0.1"
            pulls: list[tuple[KVHandle, asyncio.Future]] = []
            try:
                await self._check_layout(url)
                async with self.client.stream("POST", url + PREFILL_PATH, json=body) as r:
                    if 400 <= r.status_code < 500:
                        await r.aread()
                        message = r.json().get("error", {}).get("message", r.text[:200])
                        raise APIError(r.status_code, f"prefill server refused the prompt: {message}", None,
                                       "prefill_refused")
                    r.raise_for_status()
                    answer = None
                    async for line in r.aiter_lines():  # one line unless chunked: each block pulled as announced
                        msg = json.loads(line) if line.strip() else {}
                        if "chunk" in msg or "kv" in msg:
                            handle = KVHandle.from_json(msg["chunk"]) if "chunk" in msg else None
                            if "kv" in msg:
                                answer = PrefillResponse.from_json(msg)
                                handle = answer.kv
                            if handle is not None:
                                pulls.append((handle, asyncio.ensure_future(self._pull(handle, host))))
                        elif "done" in msg:
                            answer = PrefillResponse.from_json(msg["done"])
                        elif "error" in msg:
                            err = msg["error"]
                            if 400 <= err.get("status", 500) < 500:
                                raise APIError(err["status"], f"prefill server refused the prompt: "
                                               f"{err.get('message')}", None, "prefill_refused")
                            raise RuntimeError(err.get("message", "prefill failed"))
                    if answer is None:
                        raise RuntimeError("the prefill server's answer ended early")
                answered = time.perf_counter()
                blocks = [(h.first_page, h.num_pages, await task) for h, task in pulls]
                self.counters["prefill_answer_seconds"] += answered - start  # the prefill, as seen from here
                self.counters["kv_wait_seconds"] += time.perf_counter() - answered  # pulls not overlapped with it
                return Arrival(blocks, len(ids), answer.first_token, answer.logprobs, time.perf_counter() - start)
            except (httpx.HTTPError, RuntimeError, PrefillUnavailable, KeyError, ValueError) as e:
                self.counters["prefill_failures"] += 1
                reason = f"{url}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                log.warning("prefill on %s failed for %s (%s); trying the next", url, request_id, reason)
            finally:
                for _, task in pulls:
                    task.cancel()
        raise APIError(503, f"no prefill server could run this prompt ({reason})", None, "prefill_unavailable",
                       type_="service_unavailable")

    async def _pull(self, kv: KVHandle, prefill_host: str) -> jax.Array:
        """Pull one block on a pull thread (the event loop and the engine thread never wait on it), within
        `timeout_s`; never started past 80% of the offer's life (a pull of an expired offer would block)."""
        kv = kv.reachable_from(prefill_host)
        start = time.perf_counter()
        not_after = time.monotonic() + 0.8 * self.timeout_s
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self.pulls, self.endpoint.pull, kv.address, kv.uuid, kv.shape, kv.dtype,
                                    self.timeout_s, not_after)
        try:
            block = await asyncio.wait_for(work, self.timeout_s)
        except TimeoutError:
            self.endpoint.drop(kv.address)  # the stuck pull's connection is unusable
            raise RuntimeError(f"KV pull from {kv.address} took over {self.timeout_s:g} s") from None
        self.counters["kv_pulls"] += 1
        self.counters["kv_pull_bytes"] += int(block.nbytes)
        self.counters["kv_pull_seconds"] += time.perf_counter() - start
        return block

    async def close(self) -> None:
        await self.client.aclose()
        self.pulls.shutdown(wait=False)
