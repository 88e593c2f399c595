"""`AsyncEngine`: the engine loop in a background thread, with asyncio streams for each request.

Requests and aborts reach the loop through a thread-safe queue; each step's outputs go back to the waiting
coroutines with `loop.call_soon_threadsafe`. HTTP handling therefore never waits on a jitted step, and a
client that stops iterating aborts its request before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Protocol

from jaxserve.config.engine import EngineConfig
from jaxserve.core.outputs import RequestOutput, StepStats
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.factory import create_engine
from jaxserve.engine.llm_engine import LLMEngine

log = logging.getLogger("jaxserve")


class EngineObserver(Protocol):
    """Receives engine events on the engine thread (keep handlers quick and thread-safe)."""

    def on_step(self, stats: StepStats) -> None: ...

    def on_request_finished(self, output: RequestOutput) -> None: ...


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Thread-backed engine with an async, streaming request interface."""

    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.engine = engine if engine is not None else create_engine(config)
        self.config = config
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._observers: list[EngineObserver] = []
        self._dead: BaseException | None = None

    # Properties the server uses ------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def spec(self):
        return self.engine.spec

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def add_observer(self, observer: EngineObserver) -> None:
        self._observers.append(observer)

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    # Lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 3.0) -> None:
        """Abort everything in flight, stop the loop and join it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # Requests ------------------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       cache_salt: str | None = None, *,
                       prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its cumulative output after every step that changes it.

        Raises ValueError before yielding when the request can never be served (too long, bad ids).
        `prompt_token_ids`, when given, are the prompt's ids already checked against the vocabulary (the server
        tokenizes off the event loop; this runs on it). Stopping the iteration early aborts the request.
        """
        if not self.is_healthy:
            raise EngineDeadError("the engine loop is not running")
        ids = prompt_token_ids if prompt_token_ids is not None else self.engine.tokenize_prompt(prompt)
        self.engine.resolve_max_tokens(len(ids), params)
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._inbox.put(("add", request_id, prompt, ids, params, cache_salt))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                # Skip stale cumulative outputs when the consumer fell behind.
                while not item.finished and not stream.queue.empty():
                    nxt = stream.queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        raise nxt
                    item = nxt
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, idempotent); its pages are freed before the next step."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # The loop ------------------------------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, rid, prompt, ids, params, salt = msg
                try:
                    self.engine.add_request(rid, prompt, params, cache_salt=salt, prompt_token_ids=ids)
                except Exception as e:  # a bad request fails alone; the loop goes on
                    self._deliver_error(rid, e)
            else:
                out = self.engine.abort_request(msg[1])
                with self._lock:
                    stream = self._streams.pop(msg[1], None)
                if out is not None:
                    self._notify_finished(out)
                    if stream is not None:
                        stream.put(out)

    def _deliver_error(self, rid: str, error: BaseException) -> None:
        with self._lock:
            stream = self._streams.pop(rid, None)
        if stream is not None:
            stream.put(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            if out.finished:
                self._notify_finished(out)
            if stream is not None:
                stream.put(out)

    def _notify_finished(self, out: RequestOutput) -> None:
        for obs in self._observers:
            obs.on_request_finished(out)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                steps = self.engine.counters["steps"]
                self._deliver(self.engine.step())
                if self.engine.counters["steps"] > steps and self.engine.last_step is not None:
                    for obs in self._observers:
                        obs.on_step(self.engine.last_step)
            self._abort_all()
        except BaseException as e:  # the loop died: fail every waiting request, report unhealthy
            log.exception("engine loop died")
            self._dead = e
            with self._lock:
                streams, self._streams = self._streams, {}
            for stream in streams.values():
                stream.put(EngineDeadError(f"engine loop died: {e}"))

    def _abort_all(self) -> None:
        self._drain_inbox()
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self._inbox.put(("abort", rid))
        self._drain_inbox()
