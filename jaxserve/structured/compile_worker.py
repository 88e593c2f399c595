"""A process that compiles grammars so that the server does not have to trust llguidance with a stranger's
constraint: `python -m jaxserve.structured.compile_worker`, driven by `CompileWorker` over its pipes.

The child compiles each grammar as the server would (same limits, on a thread with the same stack size),
computes its first mask, and answers what that allocated. A segfault, a stack overflow or an allocation past
its address-space bound ends the child, not the server; a compile past its time budget is killed. Frames on
both pipes: a 4-byte big-endian length, then UTF-8 JSON. The first frame to the child holds its tokenizer and
limits; each later one a grammar source; each answer is {"ok": true, "bytes": N} or {"ok": false, "error": ...}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

COMPILE_STACK_BYTES = 64 * 2**20  # the stack every llguidance compile runs on, here and in the server
COMPILE_NICE = 10  # compiles yield the CPU to the event loop and the engine (a child, or a compile thread)
WORKER_ADDRESS_SPACE = 2 * 2**30  # the child's virtual memory: a compile that needs more aborts the child
START_TIMEOUT_S = 120.0  # the child's start: Python, llguidance, and a walk over the tokenizer's vocabulary
_HEADER = struct.Struct(">I")


def on_big_stack(fn: Any, *args: Any, stack_bytes: int = COMPILE_STACK_BYTES) -> Any:
    """`fn(*args)` on a fresh thread with a `stack_bytes` stack (headroom for llguidance's recursion beyond the
    checked limits); its result or its exception."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's own priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    with _STACK_LOCK:
        old = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=run, name="jaxserve-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(old)
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


_STACK_LOCK = threading.Lock()


# ---- the child ----

def _read(stream: Any) -> Any:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    return json.loads(stream.read(_HEADER.unpack(head)[0]).decode("utf-8", "surrogatepass"))


def _write(stream: Any, obj: Any) -> None:
    data = json.dumps(obj).encode("utf-8", "surrogatepass")
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def main() -> None:
    """The child's loop: read the setup frame, then answer one frame per grammar until stdin closes."""
    from jaxserve.structured.grammar import GrammarError, compile_matcher, ll_tokenizer_from
    from jaxserve.structured.grammar_cache import allocated_bytes, release_free_memory
    from jaxserve.structured.limits import GrammarLimits

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_ADDRESS_SPACE, WORKER_ADDRESS_SPACE))
    os.nice(COMPILE_NICE)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = _read(stdin)
    tok = ll_tokenizer_from(setup["tokenizer"])
    limits = GrammarLimits(**setup["limits"])
    _write(stdout, {"ok": True, "ready": True})
    while (source := _read(stdin)) is not None:
        before = allocated_bytes()
        try:
            m = on_big_stack(compile_matcher, tok, source, limits, stack_bytes=setup["stack_bytes"])
            answer = {"ok": True, "bytes": max(0, allocated_bytes() - before)}
            del m
        except GrammarError as e:
            answer = {"ok": False, "error": str(e)}
        release_free_memory()
        _write(stdout, answer)


# ---- the server's side ----

def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill a child, reaped on a thread (a reader blocked on its pipe sees EOF)."""
    if proc.poll() is None:
        proc.kill()
        threading.Thread(target=proc.wait, name="jaxserve-grammar-reap", daemon=True).start()


class WorkerCrashed(Exception):
    """The child died (or was killed) while compiling."""


class WorkerUnavailable(RuntimeError):
    """The child does not start: the server's fault, not the request's."""


class CompileWorker:
    """One child process, used by one compile at a time (the caller serialises); `check(source)` answers
    (ok, bytes or error) or raises WorkerCrashed / TimeoutError. A dead child is restarted on the next call.

    The child is started with posix_spawn (`close_fds=False`; our descriptors are close-on-exec), never fork:
    forking a process that runs JAX's threads is unsafe, and an event loop's own spawn (uvloop's) forks. Its
    pipes are read on a thread, which a kill unblocks."""

    def __init__(self, tokenizer_spec: dict[str, Any], limits: dict[str, Any],
                 stack_bytes: int = COMPILE_STACK_BYTES) -> None:
        self.setup = {"tokenizer": tokenizer_spec, "limits": limits, "stack_bytes": stack_bytes}
        self.proc: subprocess.Popen[bytes] | None = None  # set once its setup frame was answered
        self.starts = 0
        self._starting: asyncio.Lock | None = None  # one start at a time (the server's warm start, a first check)

    def _start(self) -> subprocess.Popen[bytes]:
        root = str(Path(__file__).resolve().parents[2])  # this checkout's jaxserve, whatever the install
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen([sys.executable, "-m", "jaxserve.structured.compile_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=False)
        return proc

    @staticmethod
    def _exchange(proc: subprocess.Popen[bytes], obj: Any) -> dict[str, Any]:
        """Send one frame and read the answer (blocking: on a thread)."""
        try:
            _write(proc.stdin, obj)
            answer = _read(proc.stdout)
        except (OSError, ValueError):
            answer = None
        if answer is None:
            raise WorkerCrashed(f"the grammar compiler process ended ({proc.wait()})")
        return answer

    async def check(self, source: str, timeout: float) -> dict[str, Any]:
        """Compile `source` in the child within `timeout` seconds (a start, when the child is not running, has
        its own budget)."""
        try:
            proc = await self.ensure_started()
            async with asyncio.timeout(timeout):
                return await asyncio.to_thread(self._exchange, proc, source)
        except (TimeoutError, WorkerCrashed, asyncio.CancelledError):
            self.kill()
            raise

    async def ensure_started(self) -> subprocess.Popen[bytes]:
        """The running child, started (and set up) first when there is none. Concurrent callers wait for one
        start: a child is handed out only after its setup frame was answered, or a check would read that answer
        as its own."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = None
                try:
                    proc = await asyncio.to_thread(self._start)
                except OSError as e:
                    raise WorkerUnavailable(f"the grammar compiler process did not start ({e})") from None
                try:
                    async with asyncio.timeout(START_TIMEOUT_S):
                        await asyncio.to_thread(self._exchange, proc, self.setup)
                except (TimeoutError, WorkerCrashed) as e:
                    _reap(proc)
                    raise WorkerUnavailable(f"the grammar compiler process did not start ({e})") from None
                except BaseException:
                    _reap(proc)
                    raise
                self.proc = proc
                self.starts += 1
            return self.proc

    def kill(self) -> None:
        """End the child (reaped on a thread; the next check starts another). Its reader thread sees EOF."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _reap(proc)

    def rss_bytes(self) -> int:
        """The child's resident memory (0 when it is not running)."""
        if self.proc is None or self.proc.poll() is not None:
            return 0
        try:
            return int(Path(f"/proc/{self.proc.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0


if __name__ == "__main__":
    main()
