"""The persistent compilation cache as the engine runs it (`runner/compilation_cache.py`): each entry written to a
temporary file and renamed into place, so a process reading the folder finds a whole entry or none."""

from pathlib import Path

import pytest

from jaxserve.runner import compilation_cache

lru_cache = pytest.importorskip("jax._src.lru_cache")


def test_an_entry_is_written_beside_its_place_then_renamed_into_it(tmp_path, monkeypatch):
    assert compilation_cache.whole_entries()
    renames = []
    real_replace = compilation_cache.os.replace
    monkeypatch.setattr(compilation_cache.os, "replace", lambda src, dst: renames.append((src, dst)) or
                        real_replace(src, dst))
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    cache.put("key", b"executable")
    final = f"key{lru_cache._CACHE_SUFFIX}"
    [(src, dst)] = renames
    assert Path(str(dst)).name == final and Path(str(src)).name.startswith(f".{final}.")
    assert Path(str(src)).parent == Path(str(dst)).parent  # the same folder: the rename is atomic
    assert cache.get("key") == b"executable" and sorted(p.name for p in tmp_path.iterdir()) == [final]
    cache.put("key", b"another")  # an entry, once there, stays as it was (jax's rule)
    assert cache.get("key") == b"executable" and len(renames) == 1


def test_a_cache_with_a_size_bound_keeps_jaxs_own_locked_writes(tmp_path):
    cache = lru_cache.LRUCache(str(tmp_path), max_size=2**20)
    cache.put("key", b"executable")
    assert cache.get("key") == b"executable"
    assert (tmp_path / f"key{lru_cache._ATIME_SUFFIX}").exists()  # jax's eviction bookkeeping, untouched
