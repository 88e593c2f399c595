"""The persistent compilation cache: XLA executables kept in a folder across processes, each entry written whole.

jax (0.10.2) writes an entry in place and reads entries without a lock unless `jax_compilation_cache_max_size` is
set, so a process could read an entry another process is still writing. Setting the size bound locks reads and
writes, but then every write lists the whole folder and reads each entry's access-time file, which entries written
without the bound lack (an error). So the engine writes each entry to a temporary file and renames it into place:
a reader finds a whole entry or none. (The test suite's worker crashes inside jax's cache calls that led here were
not torn reads after all: one came while serializing a fresh executable; docs/tuning.md.) That reaches into jax's
private cache class (`jax._src.lru_cache.LRUCache`); where the class is not the one this was written for, the
engine leaves it as it is and says so once.
"""

from __future__ import annotations

import logging
import os
import threading

import jax

logger = logging.getLogger(__name__)

_state = {"whole": None}  # whether entries are written whole: None until first asked


def enable_compilation_cache(path: str | None) -> None:
    """Persist XLA executables in `path` (None: not at all), so a restart or a second engine skips compiles; entries
    are written whole where jax's cache class allows (`whole_entries`)."""
    if path:
        whole_entries()
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def whole_entries() -> bool:
    """Make jax write each persistent cache entry to a temporary file renamed into place (once per process);
    whether it does. False, with a warning, where jax's cache class is not the one this was written for."""
    if _state["whole"] is None:
        _state["whole"] = _patch_put()
        if not _state["whole"]:
            logger.warning("jax's compilation cache class is not the one jaxserve knows: its entries are written in "
                           "place, so processes sharing --compilation-cache-dir may read one half-written; give "
                           "each its own")
    return _state["whole"]


def _patch_put() -> bool:
    try:
        from jax._src import lru_cache

        put, suffix = lru_cache.LRUCache.put, lru_cache._CACHE_SUFFIX
    except (ImportError, AttributeError):
        return False
    if getattr(put, "jaxserve_whole", False):
        return True

    def put_whole(self, key: str, value: bytes) -> None:
        if getattr(self, "eviction_enabled", True) or not key:  # jax's own path (locked when it evicts)
            return put(self, key, value)
        path = self.path / f"{key}{suffix}"
        if not path.exists():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(value)
            os.replace(tmp, path)

    put_whole.jaxserve_whole = True  # type: ignore[attr-defined]
    lru_cache.LRUCache.put = put_whole
    return True
