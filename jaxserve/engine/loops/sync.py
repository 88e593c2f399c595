"""The synchronous loop: schedule one batch, run it, wait, turn its tokens into outputs."""

from __future__ import annotations

import numpy as np

from jaxserve.core.outputs import RequestOutput
from jaxserve.engine.loops.base import StepLoop
from jaxserve.runner.prompt_logprobs import record


class SyncLoop(StepLoop):
    """One dispatch a step; the host waits for it before scheduling the next."""

    name = "synchronous"

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        start = eng.clock()
        batch = eng.scheduler.schedule()
        if batch is None:
            return []
        sampling = eng.sampling_for(batch)
        compiles = eng.compile_count()
        rows, lists = eng.prompt_rows(batch)
        result = eng.runner.collect(eng.runner.dispatch(batch, sampling, prompt_rows=rows), batch, sampling)
        compiled = eng.compile_count() > compiles
        if rows is not None:
            record(rows, result.prompt_logprobs, batch, lists)
        eng.scheduler.update_after_step(batch, np.where(batch.samples, result.tokens, -1))
        now = eng.clock()
        outputs = [out for s, req in enumerate(batch.requests) if batch.samples[s]
                   and (out := eng.emit(req, result, s, now)) is not None]
        eng.record_step(batch, start, compiled)
        return outputs
