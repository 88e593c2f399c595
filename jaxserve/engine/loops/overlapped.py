"""The overlapped loop (vLLM's async scheduling, SGLang's overlap scheduler): the host runs one step ahead.

Each `step()` schedules and dispatches step k, whose decodes read step k-1's tokens on the device through
placeholders, and only then waits for step k-1 and turns its tokens into outputs. Scheduling, batch layout and
stop checks overlap the device instead of adding to every step. A request that stops at step k-1 has computed
one wasted token in step k, which is dropped. Where the platform policy says host work slows a wide step (a CPU),
such a step runs alone, as in the synchronous loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax

from jaxserve.core.batch import RaggedBatch
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.request import Request
from jaxserve.engine.loops.base import StepLoop
from jaxserve.runner.prompt_logprobs import PromptLogprobs, PromptRows, record
from jaxserve.runner.sampler import SamplingArrays


@dataclass
class Flight:
    """A dispatched step not yet collected."""

    batch: RaggedBatch
    sampling: SamplingArrays
    pending: Any
    placeholders: list[tuple[Request, int, int]] = field(default_factory=list)
    prompt_rows: tuple[PromptRows | None, dict[int, PromptLogprobs]] = (None, {})


class OverlappedLoop(StepLoop):
    """Dispatch step k, then collect step k-1 (see the module doc)."""

    name = "overlapped"

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.flight: Flight | None = None

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        start = eng.clock()
        batch = eng.scheduler.schedule()
        prev, outputs, self.flight = self.flight, [], None
        if batch is None:
            return self._collect(prev) if prev is not None else []
        sampling = eng.sampling_for(batch)  # before any collect finishes a request of `batch`
        overlap = eng.runner.policy.overlaps(batch.num_tokens)
        # Logits processing (penalties, bans) reads each row's newest token: the step waits for the one before.
        overlap = overlap and not any(r.sampling_params.needs_processing for r in batch.requests)
        if prev is not None and not overlap:
            outputs = self._collect(prev)
        compiles = eng.compile_count()
        rows, lists = eng.prompt_rows(batch)
        flight = Flight(batch, sampling, eng.runner.dispatch(batch, sampling, prev.pending if prev else None, rows),
                        prompt_rows=(rows, lists))
        compiled = eng.compile_count() > compiles
        if prev is not None and overlap:
            outputs = self._collect(prev)
        if not overlap:
            jax.block_until_ready(flight.pending)  # no host work while a wide step runs on every core
        flight.placeholders = eng.scheduler.advance_after_dispatch(batch)
        if overlap:
            self.flight = flight
        else:
            outputs += self._collect(flight)
        eng.record_step(batch, start, compiled)  # overlapped: its duration spans the wait for step k-1
        return outputs

    def _collect(self, flight: Flight) -> list[RequestOutput]:
        """Wait for a dispatched step, write its tokens over their placeholders and post-process them."""
        eng = self.engine
        result = eng.runner.collect(flight.pending, flight.batch, flight.sampling)
        if flight.prompt_rows[0] is not None:
            record(flight.prompt_rows[0], result.prompt_logprobs, flight.batch, flight.prompt_rows[1])
        for req, index, s in flight.placeholders:
            if not req.status.finished:  # an aborted request dropped its placeholder
                req.output_token_ids[index] = int(result.tokens[s])
        now = eng.clock()
        return [out for req, _, s in flight.placeholders if (out := eng.emit(req, result, s, now)) is not None]
