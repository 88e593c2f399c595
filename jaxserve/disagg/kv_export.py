"""The prefill role: run prompts, offer each prompt's KV to the decode server that asked for it.

A prefill server is today's engine (chunked prefill, prefix caching) whose scheduler, when a request asked for by
a decode server leaves it, first gathers the request's KV pages into one block (the model's own KV heads only, so
TP replicas are never shipped) and offers it to this process's transfer server; asked for `chunked`, it offers the
pages each prefill step completed right after that step, so they move while later chunks compute. The pages
themselves are released as usual (full ones stay in the prefix cache); a block is held until the decode side pulls
it, or until `timeout_s` passes and the transfer server frees it, so a decode server that dies before pulling
leaks nothing.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxserve.core.batch import RaggedBatch
from jaxserve.core.request import Request as EngineRequest
from jaxserve.core.request import RequestStatus
from jaxserve.disagg.protocol import INFO_PATH, PREFILL_PATH, KVHandle, KVLayout, PrefillRequest, PrefillResponse
from jaxserve.disagg.transfer import TransferEndpoint
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.server.bodies import read_body
from jaxserve.server.errors import APIError
from jaxserve.server.serving import new_request_id


def kv_layout(engine: LLMEngine) -> KVLayout:
    """This engine's KV layout, as the bootstrap protocol compares it."""
    k = engine.runner.kv_caches[0][0]
    return KVLayout(model=engine.config.model_name, num_layers=len(engine.runner.kv_caches),
                    page_size=engine.config.page_size, num_kv_heads=engine.spec.num_kv_heads,
                    head_dim=int(k.shape[3]), dtype=str(k.dtype))


class _ExportingScheduler(Scheduler):
    """The prefill engine's scheduler: a wanted request's computed pages are exported after each step (chunked)
    or when it finishes (whole), before its pages are released."""

    def __init__(self, base: Scheduler, exporter: KVExporter) -> None:
        super().__init__(base.config, base.kv)
        self.exporter = exporter

    def update_after_step(self, batch: RaggedBatch, sampled_token_ids: Sequence[int] | np.ndarray) -> list[Any]:
        out = super().update_after_step(batch, sampled_token_ids)
        for req in batch.requests:
            if self.requests.get(req.request_id) is req and self.exporter.chunked(req.request_id):
                self.exporter.export(req, final=req.num_computed_tokens >= req.num_prompt_tokens)
        return out

    def finish_request(self, req: EngineRequest, status: RequestStatus) -> None:
        if (status != RequestStatus.FINISHED_ABORTED and self.requests.get(req.request_id) is req
                and self.exporter.wants(req.request_id)):
            self.exporter.export(req, final=True)
        super().finish_request(req, status)


@dataclass
class _Export:
    """One wanted request's export: its handles so far, how many of its pages they cover, who is told of each."""

    notify: Callable[[KVHandle], None] | None  # chunked: called (on the engine thread) with each new handle
    handles: list[KVHandle] = field(default_factory=list)
    pages: int = 0


class KVExporter:
    """Gathers wanted requests' KV on the engine thread and offers it; handlers `take` the handles by request id."""

    def __init__(self, engine: LLMEngine, endpoint: TransferEndpoint, timeout_s: float) -> None:
        self.engine, self.endpoint, self.timeout_s = engine, endpoint, timeout_s
        self._lock = threading.Lock()
        self._wanted: dict[str, _Export] = {}  # requests of the prefill route (plain completions export nothing)
        self.counters = {"kv_exports": 0, "kv_export_bytes": 0, "prefills": 0, "prefill_seconds": 0.0}
        engine.scheduler = _ExportingScheduler(engine.scheduler, self)
        if engine.config.warmup:
            engine.runner.warmup_transfer(engine.spec.num_kv_heads, insert=False)

    def want(self, request_id: str, notify: Callable[[KVHandle], None] | None = None) -> None:
        """Export the KV of `request_id`: chunk by chunk to `notify` when given, else whole when it finishes."""
        with self._lock:
            self._wanted[request_id] = _Export(notify)

    def wants(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._wanted

    def chunked(self, request_id: str) -> bool:
        with self._lock:
            e = self._wanted.get(request_id)
            return e is not None and e.notify is not None

    def export(self, req: EngineRequest, final: bool) -> None:
        """Offer `req`'s computed pages not offered yet: full pages only, unless `final` (its prompt is done)."""
        with self._lock:
            e = self._wanted.get(req.request_id)
        if e is None:
            return
        n, page_size = req.num_computed_tokens, self.engine.config.page_size
        upto = -(-n // page_size) if final else n // page_size
        if upto <= e.pages:
            return
        runner = self.engine.runner
        block = runner.gather_pages(req.page_ids[e.pages:upto], self.engine.spec.num_kv_heads)
        if runner.mesh is not None:  # one device's copy: the decode side re-lays heads for its own TP degree
            block = jax.device_put(block, self.endpoint.device)
        uuid = self.endpoint.offer(block, self.timeout_s)
        handle = KVHandle(self.endpoint.address, uuid, tuple(block.shape), str(block.dtype), n, e.pages, upto - e.pages)
        e.pages = upto
        with self._lock:
            e.handles.append(handle)
            self.counters["kv_exports"] += 1
            self.counters["kv_export_bytes"] += int(block.nbytes)
        if e.notify is not None:
            e.notify(handle)

    def take(self, request_id: str) -> list[KVHandle]:
        """The handles of a request's offered KV (empty if it was aborted first); forgets the request."""
        with self._lock:
            e = self._wanted.pop(request_id, None)
            return [] if e is None else list(e.handles)


def _answer(final: Any, last: KVHandle | None) -> PrefillResponse:
    if final is None or final.outputs[0].finish_reason == "abort":
        raise APIError(503, "the prefill was aborted", None, "prefill_aborted", type_="service_unavailable")
    completion = final.outputs[0]
    return PrefillResponse(completion.token_ids[0], completion.logprobs[0] if completion.logprobs else None, last)


def _api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):  # too long for this server, and the like: the client's fault
        return APIError(400, str(e), None, "invalid_value")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), type_="service_unavailable")
    return APIError(500, f"prefill failed ({type(e).__name__})")


def install_prefill_routes(app: FastAPI, engine: AsyncEngine, exporter: KVExporter, max_body_bytes: int) -> None:
    """`GET /disagg/info` (the KV layout) and `POST /disagg/prefill` (run one prompt, answer where its KV is)."""
    layout = kv_layout(engine.engine)

    @app.get(INFO_PATH)
    async def info() -> dict[str, Any]:
        return {"role": "prefill", "layout": layout.to_json(), "transfer_address": exporter.endpoint.address,
                "counters": dict(exporter.counters)}

    @app.post(PREFILL_PATH)
    async def prefill(request: Request) -> Response:
        try:
            body = PrefillRequest.from_json(json.loads(await read_body(request, max_body_bytes)))
            ids = engine.engine.tokenize_prompt(body.prompt_token_ids)  # checks the ids against the vocabulary
            params = body.sampling_params()
        except (ValueError, TypeError, KeyError) as e:
            raise APIError(400, f"bad prefill request: {e}", None, "invalid_value") from None
        rid = new_request_id("prefill")

        async def run() -> Any:
            final, start = None, time.perf_counter()
            async for out in engine.generate(rid, ids, params, body.cache_salt, prompt_token_ids=ids):
                final = out
            exporter.counters["prefills"] += 1
            exporter.counters["prefill_seconds"] += time.perf_counter() - start
            return final

        if not body.chunked:
            exporter.want(rid)
            try:
                final = await run()
            except Exception as e:
                raise _api_error(e) from None
            finally:
                handles = exporter.take(rid)
            return JSONResponse(_answer(final, handles[-1] if handles else None).to_json())
        return StreamingResponse(_chunks(run, rid, exporter), media_type="application/x-ndjson")


async def _chunks(run: Callable[[], Any], rid: str, exporter: KVExporter) -> AsyncIterator[str]:
    """The chunked answer: a line per offered block as the engine offers it, then the first token's line."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    exporter.want(rid, lambda h: loop.call_soon_threadsafe(queue.put_nowait, h))

    async def finish() -> None:  # after the engine's last offer: its callbacks were queued before the output
        try:
            queue.put_nowait(("done", await run()))
        except Exception as e:
            queue.put_nowait(("error", e))

    task = asyncio.create_task(finish())
    try:
        while True:
            item = await queue.get()
            if isinstance(item, KVHandle):
                yield json.dumps({"chunk": item.to_json()}) + "\n"
                continue
            kind, value = item
            try:
                if kind == "error":
                    raise _api_error(value)
                line = {"done": _answer(value, None).to_json()}
            except APIError as e:
                line = {"error": {**e.body()["error"], "status": e.status}}
            yield json.dumps(line) + "\n"
            return
    finally:
        task.cancel()
        exporter.take(rid)
