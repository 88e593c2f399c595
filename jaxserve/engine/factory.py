"""The one place an engine is built from an EngineConfig: colocated, disaggregated or a process of a multi-host job."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.disaggregated import DisaggregatedEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.runner import distributed


def create_engine(config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> LLMEngine:
    """The engine a config asks for: colocated `LLMEngine` or `DisaggregatedEngine`.

    With `num_processes > 1` this joins the `jax.distributed` job first. Process 0 gets an engine that announces
    every step to the others; any other process follows process 0's steps here and exits (SystemExit 0) when
    process 0 stops.
    """
    if config.num_processes > 1:
        distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)
        engine = LLMEngine(config, clock)
        if jax.process_index() == 0:
            distributed.lead(engine.runner)
            return engine
        distributed.follow(engine.runner)
        raise SystemExit(0)
    if config.disaggregate:
        return DisaggregatedEngine(config, clock)
    return LLMEngine(config, clock)
