"""What every route of the app shares: the engine, its generator and metrics, the limits and admission, and the
body parser that checks a request's model name."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from jaxserve.server.bodies import OFFLOAD_BYTES, decode, offload, read_body
from jaxserve.server.errors import APIError, excerpt
from jaxserve.server.limits import Admission, ServerLimits, check_request_shape
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.protocol import ignored_fields
from jaxserve.server.serving import Generator

logger = logging.getLogger("jaxserve.server")
M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerContext:
    """One server's shared state, built once by `build_app`."""

    engine: Any
    limits: ServerLimits
    gen: Generator
    metrics: ServerMetrics
    admission: Admission

    @classmethod
    def create(cls, engine: Any, limits: ServerLimits) -> ServerContext:
        """The context of a server for `engine` (already started); registers the metrics as its observer."""
        model_name = engine.config.model_name
        metrics = ServerMetrics(engine, model_name)
        engine.add_observer(metrics)
        waiting = None if limits.max_num_waiting is None else engine.config.max_num_seqs + limits.max_num_waiting
        return cls(engine, limits, Generator(engine, model_name, limits), metrics, Admission(waiting))

    @property
    def model_name(self) -> str:
        return self.engine.config.model_name

    @property
    def shape_check(self) -> Callable[[dict[str, Any]], None]:
        """The raw-body check of prompts x n and prompt lengths (limits.check_request_shape)."""
        return partial(check_request_shape, limits=self.limits, max_model_len=self.engine.max_model_len)

    def unknown_model(self, name: str) -> APIError:
        return APIError(404, f"The model `{excerpt(name)}` does not exist.", "model", "model_not_found")

    async def parse(self, request: Request, cls: type[M],
                    precheck: Callable[[dict[str, Any]], None] | None = None) -> tuple[M, bool]:
        """Read and validate a JSON body (off the event loop when big); returns it and whether it was big.
        415, 413, 400 for a bad body; 404 for another model's name."""
        body = await read_body(request, self.limits.max_request_body_bytes)
        big = len(body) >= OFFLOAD_BYTES
        req = await offload(big, decode, body, cls, precheck)
        ignored = ignored_fields(req)
        if ignored:  # vLLM's behaviour: accepted, and the names logged so a misspelt parameter can be found
            logger.warning("The following fields were present in the request but ignored: %s",
                           ", ".join(excerpt(n, 40) for n in ignored))
        name = getattr(req, "model", None)
        if name is not None and name != self.model_name:
            raise self.unknown_model(name)
        return req, big
