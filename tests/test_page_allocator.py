"""The page free list: page 0 is never handed out, nothing is lost or handed out twice."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.scheduler.page_allocator import TRASH_PAGE, PageAllocator


def test_hands_out_every_usable_page_once_and_never_the_trash_page() -> None:
    alloc = PageAllocator(num_pages=8)
    assert alloc.num_usable == 7 and alloc.num_free == 7
    pages = alloc.allocate(7)
    assert sorted(pages) == [1, 2, 3, 4, 5, 6, 7]
    assert TRASH_PAGE not in pages
    assert alloc.num_free == 0 and alloc.num_allocated == 7
    alloc.integrity_check()


def test_allocating_more_than_free_raises_and_hands_out_nothing() -> None:
    alloc = PageAllocator(num_pages=4)
    alloc.allocate(2)
    with pytest.raises(MemoryError, match="asked for 2 pages, 1 free"):
        alloc.allocate(2)
    assert alloc.num_free == 1
    alloc.integrity_check()


def test_freed_pages_come_back() -> None:
    alloc = PageAllocator(num_pages=4)
    a = alloc.allocate(3)
    alloc.free(a[:2])
    assert alloc.num_free == 2
    assert sorted(alloc.allocate(2)) == sorted(a[:2])
    alloc.integrity_check()


@pytest.mark.parametrize("bad", [0, 4, -1])
def test_freeing_the_trash_page_or_an_unknown_page_raises(bad: int) -> None:
    alloc = PageAllocator(num_pages=4)
    with pytest.raises(ValueError, match="not a usable page id"):
        alloc.free([bad])


def test_double_free_raises() -> None:
    alloc = PageAllocator(num_pages=4)
    (page,) = alloc.allocate(1)
    alloc.free([page])
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free([page])
    alloc.integrity_check()


def test_a_pool_needs_more_than_the_trash_page() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        PageAllocator(num_pages=1)


@settings(max_examples=60, deadline=None)
@given(num_pages=st.integers(2, 40),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 12), st.randoms(use_true_random=False)),
                    max_size=60))
def test_random_allocate_free_matches_a_set_model(num_pages: int, ops: list) -> None:
    alloc = PageAllocator(num_pages)
    held: set[int] = set()
    for is_alloc, n, rnd in ops:
        if is_alloc:
            if n > num_pages - 1 - len(held):
                with pytest.raises(MemoryError):
                    alloc.allocate(n)
            else:
                pages = alloc.allocate(n)
                assert not held & set(pages) and len(set(pages)) == n
                held |= set(pages)
        else:
            give_back = rnd.sample(sorted(held), min(n, len(held)))
            alloc.free(give_back)
            held -= set(give_back)
        assert alloc.num_allocated == len(held)
        assert set(alloc.free_pages()) == set(range(1, num_pages)) - held
        alloc.integrity_check()
