"""Compiled grammars kept for reuse, bounded by the bytes they hold rather than by their number: one small
regex can hold many times the lexer state of a large schema (docs/server.md), so a count bound bounds nothing.

An entry is charged what its compilation allocated (glibc's `mallinfo2`, measured around the compile and the
first mask, where llguidance builds its lexer); requests hold copies that share that state. Evicting frees the
entry and asks glibc to hand the freed pages back (`malloc_trim`), without which the process keeps its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

DEFAULT_CACHE_BYTES = 64 * 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc (musl, macOS): no measure, no trim
        return None


_LIBC = _libc()


def allocated_bytes() -> int:
    """Bytes the C heap holds now (small blocks and mmapped ones); 0 where glibc is absent."""
    if _LIBC is None:
        return 0
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def release_free_memory() -> None:
    """Return the heap's free pages to the OS (glibc keeps them otherwise)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class GrammarCache:
    """A thread-safe LRU of compiled grammars holding at most `capacity` charged bytes (an entry larger than
    the whole capacity is not kept)."""

    def __init__(self, capacity: int = DEFAULT_CACHE_BYTES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Hashable, value: Any, size: int) -> None:
        """Keep `value`, charged `size` bytes, evicting the least recently used entries to make room."""
        evicted = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size <= self.capacity:
                self._entries[key] = (value, size)
                self.bytes += size
            while self.bytes > self.capacity and self._entries:
                evicted.append(self._entries.popitem(last=False)[1])
                self.bytes -= evicted[-1][1]
                self.evictions += 1
        if evicted:
            evicted.clear()  # the cache's references (requests may still hold copies of theirs)
            release_free_memory()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0
        release_free_memory()
