"""The engine's step loops, one class each, chosen once at start-up (`choose_loop`): synchronous, overlapped
(asynchronous scheduling), k decode steps a dispatch, and speculative decoding. Each runs one `step()` of the
engine through its public operations (`LLMEngine.sampling_for`, `emit`, `record_step`, ...)."""

from __future__ import annotations

from typing import Any

from jaxserve.engine.loops.base import StepLoop
from jaxserve.engine.loops.multi_step import MultiStepLoop
from jaxserve.engine.loops.overlapped import OverlappedLoop
from jaxserve.engine.loops.speculative import SpeculativeLoop
from jaxserve.engine.loops.sync import SyncLoop


def choose_loop(engine: Any) -> StepLoop:
    """The loop an engine's config asks for: speculative decoding, else k steps a dispatch
    (`num_scheduler_steps` > 1), else overlapped (`async_scheduling`, resolved by the platform policy when the
    config leaves it unset), else synchronous."""
    config = engine.config
    if config.speculative_config:
        return SpeculativeLoop(engine)
    if config.num_scheduler_steps > 1:
        return MultiStepLoop(engine, config.num_scheduler_steps)
    if config.async_scheduling:
        return OverlappedLoop(engine)
    return SyncLoop(engine)


__all__ = ["MultiStepLoop", "OverlappedLoop", "SpeculativeLoop", "StepLoop", "SyncLoop", "choose_loop"]
