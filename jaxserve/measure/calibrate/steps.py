"""Engine-step measurements for calibration: lone prefills, decode batches, decodes beside a chunked prompt.

Each step is timed around `LLMEngine.step()`; a step that compiled anything is dropped. Prompts are fresh
random ids, so the prefix cache never serves them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.runner.decode_run import DecodeRunner
from planner.step_model import StepShape, decode_shape, prefill_shape


@dataclass
class StepSample:
    """One measured engine step: its shape, wall time (s) and kind (prefill | decode | mixed)."""

    shape: StepShape
    seconds: float
    kind: str = "step"


@contextmanager
def step_budget(engine, budget: int, chunk: int | None = None) -> Iterator[None]:
    """Run with step budget `budget` tokens (capped at the largest bucket) and per-request prefill chunk
    `chunk` (default: the budget), then restore the engine's own."""
    sc = engine.scheduler.config
    old = (sc.max_num_batched_tokens, sc.chunk_size)
    budget = min(budget, engine.runner.token_buckets[-1])
    engine.set_step_budget(budget, min(chunk or budget, budget))
    try:
        yield
    finally:
        engine.set_step_budget(*old)


@contextmanager
def one_step_dispatches(engine) -> Iterator[None]:
    """Within: one decode step a dispatch, so every timed `step()` is one step."""
    several, engine.decode_runner = engine.decode_runner, None
    try:
        yield
    finally:
        engine.decode_runner = several


def timed_step(engine) -> tuple[Any, float]:
    """One engine step: (its StepStats, wall seconds), seconds = nan when the step compiled something."""
    compiled = engine.runner.compile_count()
    t0 = time.perf_counter()
    engine.step()
    dt = time.perf_counter() - t0
    return engine.last_step, (dt if engine.runner.compile_count() == compiled else math.nan)


def _drive(engine, on_step: Callable[[Any, float], None]) -> None:
    """Step the engine until idle; `on_step(stats, seconds)` after each step that did not compile."""
    while engine.has_unfinished_requests():
        stats, dt = timed_step(engine)
        if stats is not None and math.isfinite(dt):
            on_step(stats, dt)


class PromptSource:
    """Fresh random prompts (no prefix-cache hits) and request ids."""

    def __init__(self, engine, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab = engine.spec.vocab_size
        self.n = 0

    def prompt(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab, size=n).tolist()

    def rid(self) -> str:
        self.n += 1
        return f"calib-{self.n}"


def _params(n: int):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def measure_prefill(engine, ids: PromptSource, lens: tuple[int, ...], repeats: int) -> list[StepSample]:
    """Lone prefills of each length (one step each when it fits the budget)."""
    samples = []
    for n in lens:
        times: list[float] = []
        for _ in range(repeats):
            engine.add_request(ids.rid(), ids.prompt(n), _params(1))
            _drive(engine, lambda s, dt, n=n, times=times: times.append(dt) if s.num_prefill_tokens == n else None)
        if times:
            samples.append(StepSample(prefill_shape(n, 0), min(times), "prefill"))
    return samples


def decode_tokens(batch: int, context: int, steps: int, budget: int) -> int:
    """Tokens each sequence of a `measure_decode` point holds at its end: prompt, the steps, the steps that early
    sequences decode while later ones prefill, and the first token."""
    return context + steps + math.ceil(batch * context / budget) + 2


def fit_decode_context(batch: int, context: int, steps: int, budget: int, max_model_len: int) -> int:
    """`context`, or the longest shorter one whose decode point fits in `max_model_len` tokens."""
    while context > 1 and decode_tokens(batch, context, steps, budget) > max_model_len:
        context -= 1
    return context


def measure_decode(engine, ids: PromptSource, batch: int, context: int, steps: int) -> list[StepSample]:
    """`batch` sequences of `context` prompt tokens decoding together: one sample, the median pure decode step."""
    times: list[float] = []
    contexts: list[int] = []
    drawn = [0]  # tokens each sequence had drawn before the step

    def record(s, dt: float) -> None:
        if s.num_prefill_tokens == 0 and s.num_decode_tokens == batch:
            times.append(dt)
            contexts.append(context + drawn[0])
            drawn[0] += 1
        elif s.num_prefill_tokens:
            drawn[0] = 1

    budget = max(1, min(engine.scheduler.config.max_num_batched_tokens, engine.scheduler.config.chunk_size))
    new_tokens = decode_tokens(batch, context, steps, budget) - context
    for _ in range(batch):
        engine.add_request(ids.rid(), ids.prompt(context), _params(new_tokens))
    _drive(engine, record)
    if not times:
        return []
    return [StepSample(decode_shape(batch, float(np.mean(contexts))), float(np.median(times)), "decode")]


def measure_mixed(engine, ids: PromptSource, decodes: int, prompt_len: int) -> list[StepSample]:
    """`decodes` running sequences while one `prompt_len` prompt is prefilled in chunks beside them."""
    samples: list[StepSample] = []
    ctx, drawn, computed = 32, 0, 0
    running = [ids.rid() for _ in range(decodes)]
    for rid in running:
        engine.add_request(rid, ids.prompt(ctx), _params(engine.max_model_len - ctx))
    while engine.has_unfinished_requests() and drawn < 2:  # prefill the decodes, then one decode step
        stats, _ = timed_step(engine)
        drawn += stats.num_prefill_tokens == 0
    engine.add_request(ids.rid(), ids.prompt(prompt_len), _params(1))
    while computed < prompt_len and engine.has_unfinished_requests():
        s, dt = timed_step(engine)
        drawn += 1
        if s.num_prefill_tokens and s.num_decode_tokens == decodes and math.isfinite(dt):
            shape = decode_shape(decodes, ctx + drawn) + prefill_shape(s.num_prefill_tokens, computed)
            samples.append(StepSample(shape, dt, "mixed"))
        computed += s.num_prefill_tokens
    for rid in running:
        engine.abort_request(rid)
    _drive(engine, lambda s, dt: None)
    return samples


def warm_engine(engine, ids: PromptSource, max_tokens: int = 256) -> None:
    """Run every token bucket with a real prefill and every sequence bucket with real decodes, once.

    The engine's warm-up compiles each bucket on an empty batch; the first non-empty run of a bucket can
    still be slower (loop bodies never executed), so measurements start after this pass. Buckets above
    `max_tokens` are skipped: their steps take long enough for a first-run cost not to matter.
    """
    limit = min(engine.config.max_num_batched_tokens, engine.config.chunk_size, engine.max_model_len - 2, max_tokens)
    for t in engine.runner.token_buckets:
        if t <= limit:
            engine.add_request(ids.rid(), ids.prompt(t), _params(2))
            _drive(engine, lambda s, dt: None)
    for b in engine.runner.seq_buckets:
        if b <= engine.config.max_num_seqs:
            for _ in range(b):
                engine.add_request(ids.rid(), ids.prompt(engine.config.page_size), _params(3))
            _drive(engine, lambda s, dt: None)


def measure_dispatch_overhead(engine, ids: PromptSource, k: int = 4, tokens: int = 33, rounds: int = 3) -> float:
    """Host seconds per dispatch that k decode steps a dispatch save: one request's time per output token with
    one step a dispatch (t1) and with k (tk), alternating `rounds` times; (t1 - tk) / (1 - 1/k), medians."""
    one_step, runner = engine.decode_runner, DecodeRunner(engine.runner, k)
    runner.warmup()
    per_token: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(rounds):
            for several in (False, True):
                engine.decode_runner = runner if several else None
                rid = ids.rid()
                engine.add_request(rid, ids.prompt(engine.config.page_size), _params(tokens))
                out = None
                while engine.has_unfinished_requests():
                    out = next((o for o in engine.step() if o.request_id == rid), out)
                times = out.metrics.token_times
                per_token[several].append((times[-1] - times[0]) / (len(times) - 1))
    finally:
        engine.decode_runner = one_step
    t1, tk = (float(np.median(per_token[s])) for s in (False, True))
    return max(0.0, (t1 - tk) / (1 - 1 / k))
