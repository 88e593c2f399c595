"""The radix prefix cache: whole-page matching, salts, locks and LRU eviction, against a reference model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxserve.scheduler.radix_cache import RadixCache

PS = 4  # page size in these examples


def test_match_returns_the_longest_cached_whole_page_prefix() -> None:
    tree = RadixCache(page_size=PS)
    tokens = list(range(100, 112))  # three pages
    tree.insert(tokens, [7, 8, 9])
    assert tree.match_prefix(tokens).page_ids == [7, 8, 9]
    assert tree.match_prefix(tokens[:11]).page_ids == [7, 8]  # a partial page never matches
    assert tree.match_prefix(tokens[:4] + [0] * 8).page_ids == [7]  # diverges in page 2
    assert tree.match_prefix([1, 2, 3, 4]).page_ids == []
    assert tree.num_pages == 3 and tree.num_evictable == 3
    tree.integrity_check()


def test_branches_share_their_common_pages() -> None:
    tree = RadixCache(page_size=PS)
    system = [1, 1, 1, 1, 2, 2, 2, 2]
    tree.insert(system + [5, 5, 5, 5], [1, 2, 3])
    result = tree.insert(system + [6, 6, 6, 6], [10, 11, 12])
    assert result.page_ids == [1, 2, 12]  # the tree's pages for the shared blocks
    assert result.duplicates == [10, 11]  # the caller's copies of those blocks, for the caller to free
    assert tree.num_pages == 4
    tree.integrity_check()


def test_different_salts_never_share() -> None:
    tree = RadixCache(page_size=PS)
    tokens = [3] * 8
    tree.insert(tokens, [1, 2], salt="tenant-a")
    assert tree.match_prefix(tokens, salt="tenant-b").page_ids == []
    assert tree.match_prefix(tokens).page_ids == []
    result = tree.insert(tokens, [3, 4], salt="tenant-b")
    assert result.duplicates == [] and result.page_ids == [3, 4]
    assert tree.match_prefix(tokens, salt="tenant-a").page_ids == [1, 2]
    tree.integrity_check()


def test_locked_paths_are_never_evicted() -> None:
    tree = RadixCache(page_size=PS)
    a = tree.insert([1] * 8, [1, 2])
    tree.insert([2] * 8, [3, 4])
    tree.lock(a.node)
    assert tree.num_locked == 2 and tree.num_evictable == 2
    assert sorted(tree.evict(10)) == [3, 4]
    assert tree.match_prefix([1] * 8).page_ids == [1, 2]
    tree.unlock(a.node)
    assert sorted(tree.evict(10)) == [1, 2]
    assert tree.num_pages == 0 and tree.num_evicted == 4
    tree.integrity_check()


def test_a_lock_on_a_deep_node_protects_its_ancestors_only() -> None:
    tree = RadixCache(page_size=PS)
    tree.insert([1] * 4 + [2] * 4, [1, 2])
    deep = tree.insert([1] * 4 + [3] * 4, [1, 3]).node
    tree.lock(deep)
    assert tree.evict(10) == [2]  # the sibling leaf goes; page 1 is an ancestor of the lock
    with pytest.raises(RuntimeError, match="unlock of an unlocked node"):
        tree.unlock(deep)
        tree.unlock(deep)


def test_eviction_is_least_recently_used_leaf_first() -> None:
    tree = RadixCache(page_size=PS)
    tree.insert([1] * 8, [1, 2])
    tree.insert([2] * 8, [3, 4])
    tree.insert([3] * 8, [5, 6])
    tree.match_prefix([1] * 8)  # path 1 is now the most recent
    assert tree.evict(1) == [4]  # leaf of path 2, the oldest
    assert tree.evict(2) == [3, 6]  # then its parent (now a leaf), then path 3's leaf
    assert tree.match_prefix([1] * 8, touch=False).page_ids == [1, 2]
    tree.integrity_check()


def test_a_peek_does_not_refresh_lru_time() -> None:
    tree = RadixCache(page_size=PS)
    tree.insert([1] * 4, [1])
    tree.insert([2] * 4, [2])
    tree.match_prefix([1] * 4, touch=False)
    assert tree.evict(1) == [1]


class RadixModel(RuleBasedStateMachine):
    """Random insert / match / lock / unlock / evict against a flat dict of paths with the same LRU clock."""

    @initialize()
    def setup(self) -> None:
        self.tree = RadixCache(page_size=2)
        self.pages = itertools.count(1)
        # reference: (salt, path of blocks) -> [page_id, last_access, lock count]
        self.ref: dict[tuple[str, tuple], list[int]] = {}
        self.clock = 0
        self.held: list[tuple[object, str, tuple]] = []  # (tree node, salt, path) of each lock

    def _paths(self, salt: str, tokens: list[int]) -> list[tuple]:
        blocks = [tuple(tokens[i:i + 2]) for i in range(0, len(tokens) - 1, 2)]
        return [tuple(blocks[: i + 1]) for i in range(len(blocks))]

    def _ref_match(self, salt: str, tokens: list[int], touch: bool) -> list[tuple]:
        if touch:
            self.clock += 1
        matched = []
        for path in self._paths(salt, tokens):
            if (salt, path) not in self.ref:
                break
            if touch:
                self.ref[(salt, path)][1] = self.clock
            matched.append(path)
        return matched

    tokens = st.lists(st.integers(0, 1), max_size=9)
    salts = st.sampled_from(["", "", "x"])

    @rule(tokens=tokens, salt=salts)
    def insert(self, tokens: list[int], salt: str) -> None:
        self._insert(tokens, salt)

    def _insert(self, tokens: list[int], salt: str, start: object = None) -> object:
        paths = self._paths(salt, tokens)
        held = getattr(start, "depth", 0)  # a caller extending its path holds the tree's pages above start
        mine = [self.ref[(salt, p)][0] if i < held else next(self.pages) for i, p in enumerate(paths)]
        result = self.tree.insert(tokens, mine, salt=salt, start=start)
        self.clock += 1
        expected, dups = [], []
        for path, page in zip(paths, mine, strict=True):
            entry = self.ref.setdefault((salt, path), [page, 0, 0])
            if entry[0] != page:
                dups.append(page)
            entry[1] = self.clock
            expected.append(entry[0])
        assert result.page_ids == expected and result.duplicates == dups
        return result.node

    @rule(tokens=tokens, salt=salts, touch=st.booleans())
    def match(self, tokens: list[int], salt: str, touch: bool) -> None:
        result = self.tree.match_prefix(tokens, salt=salt, touch=touch)
        matched = self._ref_match(salt, tokens, touch)
        assert result.page_ids == [self.ref[(salt, p)][0] for p in matched]

    @rule(tokens=tokens, salt=salts)
    def match_and_lock(self, tokens: list[int], salt: str) -> None:
        result = self.tree.match_prefix(tokens, salt=salt)
        matched = self._ref_match(salt, tokens, True)
        self.tree.lock(result.node)
        for path in matched:
            self.ref[(salt, path)][2] += 1
        self.held.append((result.node, salt, matched[-1] if matched else ()))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), more=tokens, move_lock=st.booleans())
    def extend_held_path(self, i: int, more: list[int], move_lock: bool) -> None:
        """What a running request does: insert its new pages below the node it holds, move its lock down."""
        node, salt, deepest = self.held[i % len(self.held)]
        tokens = [t for block in deepest for t in block] + more
        new = self._insert(tokens, salt, start=node)
        if move_lock:
            self.tree.extend_lock(node, new)
            paths = self._paths(salt, tokens)
            for path in paths[len(deepest):]:
                self.ref[(salt, path)][2] += 1
            self.held[i % len(self.held)] = (new, salt, paths[-1] if paths else ())

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        node, salt, deepest = self.held.pop(i % len(self.held))
        self.tree.unlock(node)
        for n in range(1, len(deepest) + 1):
            self.ref[(salt, deepest[:n])][2] -= 1

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        freed = self.tree.evict(n)
        expected = []
        for _ in range(n):
            leaves = [k for k, v in self.ref.items() if v[2] == 0
                      and not any(o[0] == k[0] and len(o[1]) == len(k[1]) + 1 and o[1][:-1] == k[1]
                                  for o in self.ref)]
            if not leaves:
                break
            victim = min(leaves, key=lambda k: self.ref[k][1])
            expected.append(self.ref.pop(victim)[0])
        assert freed == expected

    @invariant()
    def agrees(self) -> None:
        self.tree.integrity_check()
        assert self.tree.num_pages == len(self.ref)
        assert sorted(self.tree.page_ids()) == sorted(v[0] for v in self.ref.values())
        assert self.tree.num_locked == sum(v[2] > 0 for v in self.ref.values())
        for (salt, _path), v in self.ref.items():
            assert salt in ("", "x") and v[2] >= 0


RadixModel.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
test_radix_cache_matches_reference_model = RadixModel.TestCase
