"""The prefill role: run prompts, offer each finished prompt's KV to the decode server that asked for it.

A prefill server is today's engine (chunked prefill, prefix caching) whose scheduler, when a request leaves it,
first gathers the request's KV pages into one block (the model's own KV heads only, so TP replicas are never
shipped) and offers it to this process's transfer server. The pages themselves are then released as usual (full
ones stay in the prefix cache); the block is held until the decode side pulls it, or until `timeout_s` passes and
the transfer server frees it, so a decode server that dies before pulling leaks nothing.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import jax
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

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
    """The prefill engine's scheduler: a request that finishes (not aborted) has its KV exported first."""

    def __init__(self, base: Scheduler, exporter: KVExporter) -> None:
        super().__init__(base.config, base.kv)
        self.exporter = exporter

    def finish_request(self, req: EngineRequest, status: RequestStatus) -> None:
        if (status != RequestStatus.FINISHED_ABORTED and self.requests.get(req.request_id) is req
                and self.exporter.wants(req.request_id)):
            self.exporter.export(req, self.kv.pages_for(req.num_computed_tokens))
        super().finish_request(req, status)


class KVExporter:
    """Gathers finished prompts' KV on the engine thread and offers it; handlers `take` the handle by request id."""

    def __init__(self, engine: LLMEngine, endpoint: TransferEndpoint, timeout_s: float) -> None:
        self.engine, self.endpoint, self.timeout_s = engine, endpoint, timeout_s
        self._lock = threading.Lock()
        self._handles: dict[str, KVHandle] = {}
        self._wanted: set[str] = set()  # requests of the prefill route (plain completions export nothing)
        self.counters = {"kv_exports": 0, "kv_export_bytes": 0}
        engine.scheduler = _ExportingScheduler(engine.scheduler, self)
        if engine.config.warmup:
            engine.runner.warmup_transfer(engine.spec.num_kv_heads, insert=False)

    def want(self, request_id: str) -> None:
        """Export the KV of `request_id` when it finishes (called before it is submitted)."""
        with self._lock:
            self._wanted.add(request_id)

    def wants(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._wanted

    def export(self, req: EngineRequest, num_pages: int) -> None:
        """Offer the KV of `req`'s computed tokens (called before its pages are released)."""
        runner = self.engine.runner
        block = runner.gather_pages(req.page_ids[:num_pages], self.engine.spec.num_kv_heads)
        if runner.mesh is not None:  # one device's copy: the decode side re-lays heads for its own TP degree
            block = jax.device_put(block, self.endpoint.device)
        uuid = self.endpoint.offer(block, self.timeout_s)
        handle = KVHandle(self.endpoint.address, uuid, tuple(block.shape), str(block.dtype),
                          req.num_computed_tokens)
        with self._lock:
            self._handles[req.request_id] = handle
            self.counters["kv_exports"] += 1
            self.counters["kv_export_bytes"] += int(block.nbytes)

    def take(self, request_id: str) -> KVHandle | None:
        """The handle of a finished request's offered KV (None if it was aborted); forgets the request."""
        with self._lock:
            self._wanted.discard(request_id)
            return self._handles.pop(request_id, None)


def install_prefill_routes(app: FastAPI, engine: AsyncEngine, exporter: KVExporter, max_body_bytes: int) -> None:
    """`GET /disagg/info` (the KV layout) and `POST /disagg/prefill` (run one prompt, answer where its KV is)."""
    layout = kv_layout(engine.engine)

    @app.get(INFO_PATH)
    async def info() -> dict[str, Any]:
        return {"role": "prefill", "layout": layout.to_json(), "transfer_address": exporter.endpoint.address,
                "counters": dict(exporter.counters)}

    @app.post(PREFILL_PATH)
    async def prefill(request: Request) -> JSONResponse:
        try:
            body = PrefillRequest.from_json(json.loads(await read_body(request, max_body_bytes)))
            ids = engine.engine.tokenize_prompt(body.prompt_token_ids)  # checks the ids against the vocabulary
            params = body.sampling_params()
        except (ValueError, TypeError, KeyError) as e:
            raise APIError(400, f"bad prefill request: {e}", None, "invalid_value") from None
        rid = new_request_id("prefill")
        exporter.want(rid)
        final = None
        try:
            async for out in engine.generate(rid, ids, params, body.cache_salt, prompt_token_ids=ids):
                final = out
        except ValueError as e:  # too long for this server, and the like: the client's fault
            raise APIError(400, str(e), None, "invalid_value") from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type_="service_unavailable") from None
        finally:
            handle = exporter.take(rid)
        if final is None or handle is None or final.outputs[0].finish_reason == "abort":
            raise APIError(503, "the prefill was aborted", None, "prefill_aborted", type_="service_unavailable")
        completion = final.outputs[0]
        logprobs = completion.logprobs[0] if completion.logprobs else None
        return JSONResponse(PrefillResponse(completion.token_ids[0], logprobs, handle).to_json())
