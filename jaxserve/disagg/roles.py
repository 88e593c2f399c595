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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from jaxserve.config.engine import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.disagg.kv_export import KVExporter, install_prefill_routes, kv_layout
from jaxserve.disagg.kv_import import DecodeEngine
from jaxserve.disagg.protocol import INFO_PATH, remote_prefill_supported
from jaxserve.disagg.remote_prefill import PrefillRouteMiddleware, RemotePrefill, prefill_route
from jaxserve.disagg.transfer import TransferEndpoint
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.app import build_app
from jaxserve.server.limits import ServerLimits

MODES = ("prefill", "decode")
SEED_RANGE = 2**32


@dataclass(frozen=True)
class DisaggregationConfig:
    """The serve command's disaggregation flags."""

    mode: str | None = None  # None, "prefill" or "decode"
    transfer_port: int = 0
    kv_transfer_timeout: float = 60.0  # seconds an offered block waits for its pull; a decode's wait per server
    prefill_urls: tuple[str, ...] = ()  # a decode server's prefill servers when the router names none
    chunked_transfer: bool = True  # a decode server asks for each prefill chunk's pages as they are computed

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"--disaggregation-mode must be null, prefill or decode, got {self.mode!r}")
        if self.prefill_urls and self.mode != "decode":
            raise ValueError("--prefill-url is for --disaggregation-mode decode")
        if self.kv_transfer_timeout <= 0:
            raise ValueError("--kv-transfer-timeout must be positive")

    def check(self, config: EngineConfig) -> None:
        """Refuse what a role cannot run with (ValueError, one line)."""
        if self.mode is None:
            return
        if config.disaggregate or config.num_processes > 1:
            raise ValueError("--disaggregation-mode runs one engine per process (not with --disaggregate or several "
                             "processes)")
        if config.kv_cache_dtype != "auto":
            raise ValueError("--disaggregation-mode moves float pages: use --kv-cache-dtype auto")
        if self.mode == "decode" and (config.async_scheduling or config.num_scheduler_steps > 1
                                      or config.speculative_config):
            raise ValueError("a decode server runs the synchronous loop (no async scheduling, multi-step or "
                             "speculation yet)")

    def engine(self, config: EngineConfig, host: str) -> AsyncEngine:
        """This role's started-to-be engine (not started)."""
        self.check(config)
        if self.mode is None:
            return AsyncEngine(config)
        endpoint = TransferEndpoint(host, self.transfer_port)
        if self.mode == "prefill":
            return PrefillAsyncEngine(config, endpoint, self.kv_transfer_timeout)
        return DecodeAsyncEngine(config, endpoint, self.kv_transfer_timeout, self.prefill_urls, self.chunked_transfer)

    def app(self, engine: AsyncEngine, log_interval: float = 10.0, limits: ServerLimits | None = None) -> FastAPI:
        """The HTTP app for this role around a started `engine` (from `self.engine`)."""
        limits = limits or ServerLimits()
        app = build_app(engine, log_interval=log_interval, limits=limits)
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


class PrefillAsyncEngine(AsyncEngine):
    """The prefill role's engine: colocated, with its finished prompts' KV exported."""

    def __init__(self, config: EngineConfig, endpoint: TransferEndpoint, timeout_s: float) -> None:
        super().__init__(config)
        self.exporter = KVExporter(self.engine, endpoint, timeout_s)


class DecodeAsyncEngine(AsyncEngine):
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
