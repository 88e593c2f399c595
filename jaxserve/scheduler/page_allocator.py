"""Host-side free list of KV pages.

Page ids are indices into the device KV pool. Page 0 is the trash page that absorbs padded writes, so it is
never handed out: the allocator manages pages 1..num_pages-1. It keeps no reference counts; sharing (the
prefix cache) is tracked one level up, in the KV-cache manager.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

TRASH_PAGE = 0


class PageAllocator:
    """A FIFO free list of page ids, with a per-page allocated flag for checks."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is the trash page), got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._allocated = np.zeros(num_pages, dtype=bool)

    @property
    def num_usable(self) -> int:
        """Pages that can ever be handed out (all but the trash page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return self.num_usable - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Hand out `n` page ids; raises MemoryError (and hands out nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise MemoryError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        self._allocated[pages] = True
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list; freeing page 0, an unknown or a free page raises ValueError."""
        pages = list(pages)
        for p in pages:
            if not 0 < p < self.num_pages:
                raise ValueError(f"page {p} is not a usable page id (1..{self.num_pages - 1})")
            if not self._allocated[p]:
                raise ValueError(f"page {p} is freed twice")
            self._allocated[p] = False
        self._free.extend(pages)

    def is_allocated(self, page: int) -> bool:
        return bool(self._allocated[page])

    def allocated_pages(self) -> list[int]:
        """Pages handed out and not yet freed (for checks and tests)."""
        return np.flatnonzero(self._allocated).tolist()

    def free_pages(self) -> list[int]:
        """A copy of the free list (for checks and tests)."""
        return list(self._free)

    def integrity_check(self) -> None:
        """Assert free + allocated == usable, no duplicates, page 0 never free or allocated."""
        free = np.fromiter(self._free, dtype=np.int64, count=len(self._free))
        assert not self._allocated[TRASH_PAGE], "trash page 0 is marked allocated"
        if free.size:
            assert free.min() >= 1 and free.max() < self.num_pages, "free list holds an out-of-range page"
            assert np.unique(free).size == free.size, "free list holds a page twice"
            assert not self._allocated[free].any(), "a page is both free and allocated"
        assert free.size + int(self._allocated.sum()) == self.num_usable, (
            f"free {free.size} + allocated {int(self._allocated.sum())} != usable {self.num_usable}")
