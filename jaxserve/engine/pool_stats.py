"""Busy time and work done by each pool of a disaggregated engine, the runtime side of the P:D balance.

A pool's capacity is the work it does per second of being busy: the prefill pool's prompts per busy second, the
decode pool's output tokens per busy second. Busy time is measured per step:

- prefill: from scheduling the step to the moment its outputs are ready on the device. The step is dispatched
  and collected asynchronously (the engine only looks at it between decode steps), so a waiter thread blocks on
  the step's outputs and stamps the time they become ready; time the finished step then waits to be collected
  is not counted. The KV gather that follows (a small copy on the prefill devices) is not counted either.
- decode: the whole synchronous decode step (schedule, forward, sample, stop checks), as colocated engine steps
  are timed for calibration.

A server of one role (`jaxserve serve --disaggregation-mode prefill|decode`) is one pool by itself: its engine's
steps are counted into the same counters by `StepPoolCounters` (an engine observer; each step's whole duration,
schedule to outputs, is busy time: a step with prefill rows is a prefill step, one of decodes only a decode step),
and its `/metrics` shows them (`jaxserve:prefill_busy_seconds_total`, ...).

Counters are cumulative (`engine.counters`); `pool_rates` turns them (or a run's deltas) into rates. The engine
also keeps each pool's recent steps (`PoolStep`: busy interval and shape); `overlap_fractions` says how much of
each step ran while the other pool was busy (on devices that share hardware, e.g. fake CPU devices on the same
cores, that is when they slow each other down).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

POOL_COUNTERS: dict[str, float] = {
    "prefill_steps": 0, "prefill_busy_seconds": 0.0, "prefill_prompts": 0, "prefill_prompt_tokens": 0,
    "decode_steps": 0, "decode_busy_seconds": 0.0, "decode_output_tokens": 0, "decode_batch_seqs": 0,
}


class PoolStep(NamedTuple):
    """One step of a pool: its busy interval (perf_counter seconds) and its shape, as the step model takes it."""

    start: float
    end: float
    num_decodes: int
    decode_context_tokens: int  # sum of the decodes' KV lengths, the new token included
    prefill_chunks: tuple[tuple[int, int], ...]  # (chunk tokens, tokens before it)

    @classmethod
    def of_batch(cls, start: float, end: float, batch: Any) -> PoolStep:
        """A step that ran `batch` (a `RaggedBatch`)."""
        q = np.diff(batch.cu_q_lens)
        chunks = tuple((int(q[s]), int(batch.kv_lens[s] - q[s])) for s in range(batch.num_decodes, batch.num_seqs))
        return cls(start, end, batch.num_decodes, int(batch.kv_lens[: batch.num_decodes].sum()), chunks)

    @classmethod
    def of_stats(cls, start: float, end: float, stats: Any) -> PoolStep:
        """A step described by the engine's `StepStats`."""
        return cls(start, end, stats.num_decode_tokens, stats.decode_context_tokens, tuple(stats.prefill_chunks))


class StepPoolCounters:
    """POOL_COUNTERS of one engine's steps, fed as an engine observer (`AsyncEngine.add_observer`).

    A step with prefill rows counts for the prefill pool (its prompts done, its prompt tokens); a step of decodes
    only for the decode pool (one output token per decode row). A role server runs only one kind.
    """

    def __init__(self) -> None:
        self.counters: dict[str, float] = dict(POOL_COUNTERS)

    def on_step(self, stats: Any) -> None:
        """Count one finished step (a `StepStats`); called on the engine thread."""
        c = self.counters
        if stats.num_prefill_tokens:
            c["prefill_steps"] += 1
            c["prefill_busy_seconds"] += stats.duration
            c["prefill_prompts"] += stats.num_prompts_done
            c["prefill_prompt_tokens"] += stats.num_prefill_tokens
        elif stats.num_decode_tokens:
            c["decode_steps"] += 1
            c["decode_busy_seconds"] += stats.duration
            c["decode_output_tokens"] += stats.num_decode_tokens
            c["decode_batch_seqs"] += stats.num_decode_tokens

    def on_request_finished(self, output: Any) -> None:
        """Nothing: requests are counted by the steps that ran them."""


class ReadyStamp:
    """The `time.perf_counter()` at which dispatched device outputs became ready, stamped by a waiter thread."""

    def __init__(self, pending: Any) -> None:
        self._ready_at = 0.0
        self._thread = threading.Thread(target=self._wait, args=(pending,), daemon=True)
        self._thread.start()

    def _wait(self, pending: Any) -> None:
        jax.block_until_ready(pending)
        self._ready_at = time.perf_counter()

    def ready_at(self) -> float:
        """Block until the outputs are ready; the time they became so."""
        self._thread.join()
        return self._ready_at


def pool_rates(counters: dict[str, float]) -> dict[str, float | None]:
    """Per-pool rates from cumulative counters (or a run's deltas); None where a pool did no work.

    `prefill_prompts_per_busy_s`: prefill capacity in requests/s; `decode_tokens_per_busy_s`: decode capacity in
    output tokens/s (divide by output_len - 1 for requests/s: the first token comes from the prefill pool);
    `decode_mean_batch`: sequences per decode step; `*_step_ms`: mean busy time per step.
    """

    def ratio(a: str, b: str, scale: float = 1.0) -> float | None:
        return scale * counters[a] / counters[b] if counters.get(b) else None

    return {"prefill_prompts_per_busy_s": ratio("prefill_prompts", "prefill_busy_seconds"),
            "prefill_tokens_per_busy_s": ratio("prefill_prompt_tokens", "prefill_busy_seconds"),
            "prefill_step_ms": ratio("prefill_busy_seconds", "prefill_steps", 1e3),
            "decode_tokens_per_busy_s": ratio("decode_output_tokens", "decode_busy_seconds"),
            "decode_step_ms": ratio("decode_busy_seconds", "decode_steps", 1e3),
            "decode_mean_batch": ratio("decode_batch_seqs", "decode_steps")}


def overlap_fractions(steps: Sequence[PoolStep], other: Sequence[PoolStep]) -> list[float]:
    """For each of `steps`, the fraction of its busy interval during which one of `other` ran (both in order)."""
    out, j = [], 0
    for s in steps:
        while j < len(other) and other[j].end <= s.start:
            j += 1
        both, k = 0.0, j
        while k < len(other) and other[k].start < s.end:
            both += max(0.0, min(s.end, other[k].end) - max(s.start, other[k].start))
            k += 1
        out.append(both / (s.end - s.start) if s.end > s.start else 0.0)
    return out
