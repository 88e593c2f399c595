"""The server's grammar compiler: every constraint is checked, compiled in a worker process, then compiled
again here, off the event loop, and cached by bytes.

Why a process: llguidance is native code, and a segfault or a stack overflow in a thread ends the whole
server; a thread also cannot be stopped when a compile runs past its budget. So a small pool of child
processes (structured/compile_worker.py) compiles each new grammar first, with the same limits and the same
stack size, and computes its first mask; a crash or a timeout there costs that one request (a 400) and a
child restart. Only a grammar that compiled cleanly there is compiled here, on a thread with a 64 MB stack
(llguidance releases the GIL while it compiles, so /health and other streams go on), and its compiled form is
attached to the request's params for the engine to copy. The second compile costs what the first did (a few
ms for a typical schema; docs/server.md has the figures). Concurrent requests for one grammar share its
compile; a client that goes away does not cancel a compile others may wait for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxserve.core.sampling_params import StructuredOutputsParams
from jaxserve.structured.compile_worker import (
    COMPILE_STACK_BYTES,
    CompileWorker,
    WorkerCrashed,
    WorkerUnavailable,
    on_big_stack,
)
from jaxserve.structured.grammar import CompiledGrammar, compile_grammar, grammar_source, tokenizer_spec
from jaxserve.structured.grammar_cache import DEFAULT_CACHE_BYTES, GrammarCache
from jaxserve.structured.limits import (
    DEFAULT_LIMITS,
    GrammarError,
    GrammarLimitError,
    GrammarLimits,
    llguidance_module,
)

logger = logging.getLogger("jaxserve.structured")
DEFAULT_COMPILE_TIMEOUT_S = 10.0
NUM_WORKERS = 2  # one slow compile (up to the timeout) leaves the other for everyone else
WORKER_MAX_RSS = 512 * 2**20  # a child past this after a compile is restarted (glibc keeps freed pages)


class GrammarCompiler:
    """Compiles the constraints of one model's requests (see the module docstring). `cache_bytes` bounds the
    compiled grammars kept; one grammar may hold at most a quarter of it (so the cache always keeps several)."""

    def __init__(self, tokenizer: Any, vocab_size: int, limits: GrammarLimits = DEFAULT_LIMITS,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 num_workers: int = NUM_WORKERS, worker_stack_bytes: int = COMPILE_STACK_BYTES) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits
        self.timeout_s = timeout_s
        self.cache = GrammarCache(cache_bytes)
        self.max_grammar_bytes = max(1, cache_bytes // 4)
        self.num_workers = num_workers
        self.worker_stack_bytes = worker_stack_bytes  # at most the 64 MB compiles here run on (tests lower it)
        self.workers: list[CompileWorker] = []
        self._idle: asyncio.Queue[CompileWorker] | None = None
        self._pending: dict[str, asyncio.Future[CompiledGrammar]] = {}
        self.crashes = self.timeouts = 0
        # Checks and compiles here, two at a time: more would only contend for the GIL with the event loop.
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxserve-grammar")

    def _pool(self) -> asyncio.Queue[CompileWorker]:
        if self._idle is None:
            spec = tokenizer_spec(self.tokenizer, self.vocab_size)  # GrammarError without a tokenizer
            self._idle = asyncio.Queue()
            for _ in range(self.num_workers):
                worker = CompileWorker(spec, dataclasses.asdict(self.limits), self.worker_stack_bytes)
                self.workers.append(worker)
                self._idle.put_nowait(worker)
        return self._idle

    async def start(self) -> None:
        """Start the child processes now (a server calls it at start-up, so that the first grammars do not wait
        for them); without llguidance, or a tokenizer llguidance can use, it starts none."""
        try:
            llguidance_module()
            idle = self._pool()
        except GrammarError:
            return
        try:
            await asyncio.gather(*(w.ensure_started() for w in self.workers))
        except (OSError, WorkerUnavailable) as e:  # they start again on first use
            logger.warning("the grammar compiler processes did not start (%s); they will on first use", e)
        assert idle is self._idle

    async def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """`spec`'s compiled grammar (cached, or compiled now); raises GrammarError (GrammarLimitError for a
        limit) with a one-line message, or WorkerUnavailable when no compiler process starts."""
        loop = asyncio.get_running_loop()
        source = await loop.run_in_executor(self._threads, grammar_source, spec, self.limits)  # Python: off the loop
        hit = self.cache.get(source)
        if hit is not None:
            return hit
        task = self._pending.get(source)
        if task is None:
            task = asyncio.ensure_future(self._compile(source))
            self._pending[source] = task
            task.add_done_callback(lambda t: self._done(source, t))
        return await asyncio.shield(task)

    def _done(self, source: str, task: asyncio.Future[CompiledGrammar]) -> None:
        self._pending.pop(source, None)
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have gone

    async def attach(self, spec: StructuredOutputsParams) -> StructuredOutputsParams:
        """`spec` with its compiled grammar attached (what the engine copies)."""
        return dataclasses.replace(spec, compiled=await self.compile(spec))

    async def _compile(self, source: str) -> CompiledGrammar:
        nbytes = await self._check_in_worker(source)
        if nbytes > self.max_grammar_bytes:
            raise GrammarLimitError(f"the constraint takes {nbytes / 2**20:.1f} MB compiled, past this server's "
                                    f"limit of {self.max_grammar_bytes / 2**20:.1f} MB a grammar (a quarter of "
                                    "--structured-outputs-cache-bytes)")
        compiled = await asyncio.get_running_loop().run_in_executor(
            self._threads, on_big_stack, compile_grammar, self.tokenizer, self.vocab_size, source, self.limits)
        compiled.nbytes = nbytes  # the child measured it alone; here other threads allocate meanwhile
        self.cache.put(source, compiled, nbytes)
        return compiled

    async def _check_in_worker(self, source: str) -> int:
        """Bytes `source` allocates compiled, from a child; GrammarError when it fails, crashes (twice: a
        child killed for another reason gets one retry) or runs past the timeout."""
        idle = self._pool()
        worker = await idle.get()
        try:
            for attempt in range(2):
                try:
                    answer = await worker.check(source, self.timeout_s)
                    break
                except TimeoutError:
                    self.timeouts += 1
                    logger.warning("a grammar compile ran past %.1f s: its compiler process was restarted",
                                   self.timeout_s)
                    raise GrammarLimitError(f"the constraint did not compile within {self.timeout_s:g} s (this "
                                            "server's --structured-outputs-compile-timeout)") from None
                except WorkerCrashed as e:
                    self.crashes += 1
                    logger.warning("a grammar crashed its compiler process (%s); restarted", e)
                    if attempt:
                        raise GrammarError("the constraint crashed the grammar compiler (in a process of its "
                                           "own: nothing else was affected)") from None
        finally:
            if worker.rss_bytes() > WORKER_MAX_RSS:
                worker.kill()
            idle.put_nowait(worker)
        if not answer["ok"]:
            raise GrammarError(answer["error"])
        return int(answer["bytes"])

    def close(self) -> None:
        """End the child processes (they also end by themselves when this process does)."""
        for worker in self.workers:
            worker.kill()

    def rss_bytes(self) -> int:
        """Resident memory of the child processes together."""
        return sum(w.rss_bytes() for w in self.workers)
