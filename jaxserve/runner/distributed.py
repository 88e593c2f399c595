"""Multi-host serving with JAX's own distributed runtime (`jax.distributed`), SPMD.

Every process runs the same engine over one mesh that spans all processes' devices (tensor parallelism across
hosts). Process 0 alone schedules: before each step it broadcasts the step's decision (the ragged batch and its
sampling rows, packed into one int32 vector) with `multihost_utils.broadcast_one_to_all`; the other processes
receive it and run the same jitted step, so every collective inside the step lines up. When process 0 stops,
it broadcasts a stop message and the followers return.

`jaxserve serve --coordinator-address HOST:PORT --num-processes N --process-id I` (or the same `LLM(...)`
keywords): process 0 serves HTTP (or the offline API); every other process follows and exits when process 0
stops.
"""

from __future__ import annotations

import atexit

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxserve.core.batch import RaggedBatch
from jaxserve.runner.sampler import SamplingArrays

STOP, STEP = 0, 1
_MIN_MESSAGE = 256
_initialized = False


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Join the job (once per process, before anything touches a JAX backend)."""
    global _initialized
    if _initialized:
        return
    # CPU processes need a cross-process collectives backend; GPUs and TPUs bring their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    _initialized = True


def _broadcast(x: np.ndarray) -> np.ndarray:
    return np.asarray(multihost_utils.broadcast_one_to_all(x, is_source=jax.process_index() == 0))


def pack(batch: RaggedBatch, sampling: SamplingArrays) -> np.ndarray:
    """One int32 vector holding a step's batch and sampling rows (floats bit-cast), padded to a power of two."""
    s, t = batch.num_seqs, batch.num_tokens
    rows = sampling.temperature.shape[0]
    head = np.array([s, t, batch.num_decodes, batch.page_table.shape[1], int(sampling.want_logprobs), rows],
                    np.int32)
    parts = [head, batch.token_ids, batch.positions, batch.slot_mapping, batch.cu_q_lens, batch.kv_lens,
             batch.page_table.ravel(), batch.logits_indices, batch.samples.astype(np.int32),
             sampling.temperature.view(np.int32), sampling.top_k, sampling.top_p.view(np.int32),
             sampling.min_p.view(np.int32), sampling.seed.view(np.int32), sampling.step]
    flat = np.concatenate([np.asarray(p, np.int32) for p in parts])
    size = max(_MIN_MESSAGE, 1 << int(len(flat) - 1).bit_length())
    return np.pad(flat, (0, size - len(flat)))


def unpack(buf: np.ndarray) -> tuple[RaggedBatch, SamplingArrays]:
    """Inverse of `pack` (the batch's `requests` are placeholders: followers hold no request state)."""
    s, t, num_decodes, max_pages, want_logprobs, rows = (int(x) for x in buf[:6])
    pos = 6

    def take(n: int) -> np.ndarray:
        nonlocal pos
        out = buf[pos: pos + n]
        pos += n
        return out

    token_ids, positions, slots = take(t), take(t), take(t)
    cu, kv_lens = take(s + 1), take(s)
    table = take(s * max_pages).reshape(s, max_pages)
    logits_indices, samples = take(s), take(s).astype(bool)
    batch = RaggedBatch(requests=[None] * s, num_decodes=num_decodes, token_ids=token_ids, positions=positions,
                        cu_q_lens=cu, kv_lens=kv_lens, page_table=table, slot_mapping=slots,
                        logits_indices=logits_indices, samples=samples)
    sampling = SamplingArrays(temperature=take(rows).view(np.float32), top_k=take(rows),
                              top_p=take(rows).view(np.float32), min_p=take(rows).view(np.float32),
                              seed=take(rows).view(np.uint32), step=take(rows), want_logprobs=bool(want_logprobs))
    return batch, sampling


def send_step(batch: RaggedBatch, sampling: SamplingArrays) -> None:
    """Process 0: tell the followers what the next step runs."""
    body = pack(batch, sampling)
    _broadcast(np.array([STEP, len(body)], np.int32))
    _broadcast(body)


def send_stop() -> None:
    """Process 0: release the followers."""
    _broadcast(np.array([STOP, 0], np.int32))


def follow(runner) -> int:
    """Processes > 0: run every step process 0 announces until it stops; returns the number of steps."""
    steps = 0
    while True:
        op, size = (int(x) for x in _broadcast(np.zeros(2, np.int32)))
        if op == STOP:
            return steps
        batch, sampling = unpack(_broadcast(np.zeros(size, np.int32)))
        runner.execute(batch, sampling)
        steps += 1


def lead(runner) -> None:
    """Process 0: announce every step to the followers, and stop them when this process exits."""
    runner.step_hook = send_step
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            send_stop()

    runner.stop_followers = stop
    atexit.register(stop)
