"""k decode steps a dispatch (`--num-scheduler-steps`): while every running request decodes, one jitted call runs
k steps with stops checked on the device (runner/decode_run.py); otherwise a synchronous step."""

from __future__ import annotations

import numpy as np

from jaxserve.core.outputs import RequestOutput
from jaxserve.engine.loops.sync import SyncLoop
from jaxserve.runner.decode_run import DecodeRun, DecodeRunner, can_run_on_device
from jaxserve.runner.model_runner import StepResult


class MultiStepLoop(SyncLoop):
    """The synchronous loop, with runs of k decode steps whenever the running requests allow them."""

    name = "k steps a dispatch"

    def __init__(self, engine, k: int) -> None:
        super().__init__(engine)
        self.decode_runner = DecodeRunner(engine.runner, k)

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        start = eng.clock()
        if can_run_on_device(eng.scheduler.running):
            run = eng.scheduler.schedule_decode_run(self.decode_runner.k)
            if run is not None:
                return self._decode_run(*run, start)
        return super().step()

    def _decode_run(self, batch, limits: list[int], start: float) -> list[RequestOutput]:
        """Up to k decode steps in one dispatch; each sequence's tokens past its stop (or a stop string) dropped."""
        eng = self.engine
        sampling = eng.sampling_for(batch)
        compiles = eng.compile_count()
        run = DecodeRun.build(batch, limits, self.decode_runner.k, eng.config.page_size)
        drawn = self.decode_runner.execute(batch, sampling, run)
        no_logprobs = np.full(drawn.shape[0], np.nan, np.float32)  # none asked for (can_run_on_device), none computed
        compiled = eng.compile_count() > compiles
        now = eng.clock()
        outputs = []
        for s, req in enumerate(batch.requests):
            out = eng.emit_tokens(req, StepResult(drawn[:, s], no_logprobs, None, None), range(limits[s]), now)
            if out is not None:
                outputs.append(out)
        eng.record_step(batch, start, compiled)
        return outputs

    def warmup(self) -> None:
        self.decode_runner.warmup()

    def compile_count(self) -> int:
        return self.decode_runner.compile_count()
