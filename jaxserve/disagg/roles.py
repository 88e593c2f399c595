"""A server's role in disaggregated serving (SGLang's `--disaggregation-mode`): its engine and its app.

- `None` (null): today's colocated server.
- `"prefill"`: the colocated engine whose finished prompts' KV is offered for pulling (`kv_export.py`), plus the
  bootstrap routes (`/disagg/info`, `/disagg/prefill`); clients normally reach it only through a decode server.
- `"decode"`: `DecodeEngine` (`kv_import.py`) behind the OpenAI API; each request is prefilled on a prefill
  server (`remote_prefill.py`), its KV pulled here, and decoded here.

Both roles start one transfer server on the serving host (port `transfer_port`, 0: any free one).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from jaxserve.config.engine import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.disagg.config import DisaggregationConfig
from jaxserve.disagg.kv_export import KVExporter, install_prefill_routes, kv_layout
from jaxserve.disagg.kv_import import DecodeEngine
from jaxserve.disagg.protocol import INFO_PATH, remote_prefill_supported
from jaxserve.disagg.remote_prefill import PrefillRouteMiddleware, RemotePrefill, prefill_route
from jaxserve.disagg.transfer import TransferEndpoint
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.pool_stats import StepPoolCounters
from jaxserve.server.app import build_app
from jaxserve.server.limits import ServerLimits

SEED_RANGE = 2**32


def role_engine(role: DisaggregationConfig, config: EngineConfig, host: str) -> AsyncEngine:
    """The engine of `role` (not started); ValueError, one line, for what the role cannot run with."""
    role.check(config)
    if role.mode is None:
        return AsyncEngine(config)
    endpoint = TransferEndpoint(host, role.transfer_port)
    if role.mode == "prefill":
        return PrefillAsyncEngine(config, endpoint, role.kv_transfer_timeout)
    return DecodeAsyncEngine(config, endpoint, role.kv_transfer_timeout, role.prefill_urls, role.chunked_transfer)


def role_app(engine: AsyncEngine, limits: ServerLimits | None = None, **app_args: Any) -> FastAPI:
    """The HTTP app around a started `engine` from `role_engine`: `build_app`'s, plus the role's routes."""
    limits = limits or ServerLimits()
    app = build_app(engine, limits=limits, **app_args)
    if isinstance(engine, PrefillAsyncEngine):
        install_prefill_routes(app, engine, engine.exporter, limits.max_request_body_bytes)
    elif isinstance(engine, DecodeAsyncEngine):
        app.add_middleware(PrefillRouteMiddleware)
        layout = engine.remote.layout

        @app.get(INFO_PATH)
        async def info() -> dict[str, Any]:
            stats = engine.stats()
            counters = {k: stats[k] for k in ("kv_imports", "kv_import_bytes", "kv_insert_seconds")}
            return {"role": "decode", "layout": layout.to_json(), "prefill_urls": list(engine.prefill_urls),
                    "counters": {**counters, **engine.remote.counters}}
    return app


class _PoolAsyncEngine(AsyncEngine):
    """A role's engine: one pool, its steps' busy time and work in its stats (`StepPoolCounters`), for /metrics,
    beside the CPU seconds this process has used (all its threads: the pool's share of shared cores)."""

    def __init__(self, config: EngineConfig, engine: Any = None) -> None:
        super().__init__(config, engine=engine)
        self.pool = StepPoolCounters()
        self.add_observer(self.pool)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), **self.pool.counters, "process_cpu_seconds": time.process_time()}


class PrefillAsyncEngine(_PoolAsyncEngine):
    """The prefill role's engine: colocated, with its finished prompts' KV exported."""

    def __init__(self, config: EngineConfig, endpoint: TransferEndpoint, timeout_s: float) -> None:
        super().__init__(config)
        self.exporter = KVExporter(self.engine, endpoint, timeout_s)


class DecodeAsyncEngine(_PoolAsyncEngine):
    """The decode role's engine: each eligible request is prefilled remotely before it is submitted."""

    def __init__(self, config: EngineConfig, endpoint: TransferEndpoint, timeout_s: float,
                 prefill_urls: tuple[str, ...], chunked: bool = True) -> None:
        super().__init__(config, engine=DecodeEngine(config))
        self.prefill_urls = prefill_urls
        self.remote = RemotePrefill(kv_layout(self.engine), endpoint, timeout_s, chunked)

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       cache_salt: str | None = None, *,
                       prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        urls = tuple(dict.fromkeys(prefill_route.get() + self.prefill_urls))
        if urls and remote_prefill_supported(params) and self.is_healthy:
            ids = prompt_token_ids if prompt_token_ids is not None else self.engine.tokenize_prompt(prompt)
            self.engine.resolve_max_tokens(len(ids), params)  # a bad request fails here, before any prefill
            if params.seed is None:  # one seed on both sides: the first token and the rest are one stream
                params = dataclasses.replace(params, seed=secrets.randbelow(SEED_RANGE))
            arrival = await self.remote.run(urls, request_id, ids, params, cache_salt)
            self.engine.stage(request_id, arrival)
            prompt_token_ids = ids
        try:
            async for out in super().generate(request_id, prompt, params, cache_salt,
                                              prompt_token_ids=prompt_token_ids):
                yield out
        finally:
            self.engine.unstage(request_id)
