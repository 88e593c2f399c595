"""What every step loop offers the engine."""

from __future__ import annotations

from typing import Any

from jaxserve.core.outputs import RequestOutput


class StepLoop:
    """One way of running the engine's steps. `step()` schedules, runs and post-processes (its outputs: every
    request that drew a token or finished); the rest has defaults for loops with nothing of their own to compile
    or count."""

    name = "loop"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def step(self) -> list[RequestOutput]:
        raise NotImplementedError

    def check(self, params: Any) -> None:
        """ValueError when a request's SamplingParams ask for what this loop cannot run (checked at submission)."""

    def warmup(self) -> None:
        """Compile what the loop runs beside the runner's own step functions."""

    def compile_count(self) -> int:
        """Compiled variants of the loop's own functions (the runner's are counted by the runner)."""
        return 0

    def stats(self) -> dict[str, float]:
        """The loop's own counters, merged into the engine's stats."""
        return {}
