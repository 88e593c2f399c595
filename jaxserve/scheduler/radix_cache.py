"""Radix tree of cached KV pages (SGLang's RadixAttention, page-granular).

Each node is one full page: its key is the page's `page_size` tokens and it holds the page id whose KV was
computed for exactly the tokens on the path from the root. Only full pages are cached, so a shared page is
never written again and needs no copy-on-write. Each `cache_salt` gets its own root, so different salts never
share a page (None and "" both mean unsalted). Edges are not path-compressed: one node per page.

A lock on a node is propagated to every ancestor (the lock count of a node is the number of holders whose
path runs through it); locked nodes are never evicted. Eviction removes unlocked leaves, least recently
accessed first, and hands their page ids back to the caller. "Time" is a logical clock ticked by every match
and insert, so behaviour is deterministic.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

DEFAULT_SALT = ""


class RadixNode:
    """One cached page; a salt root has no page (page_id -1) and no key."""

    __slots__ = ("key", "page_id", "parent", "children", "lock_ref", "last_access", "depth", "salt")

    def __init__(self, key: tuple[int, ...], page_id: int, parent: RadixNode | None, salt: str) -> None:
        self.key = key
        self.page_id = page_id
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.depth = 0 if parent is None else parent.depth + 1
        self.salt = salt

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"RadixNode(page={self.page_id}, depth={self.depth}, lock={self.lock_ref}, salt={self.salt!r})"


class MatchResult(NamedTuple):
    page_ids: list[int]  # cached pages of the longest matching whole-page prefix
    node: RadixNode  # the deepest matched node (the salt root when nothing matched)


class InsertResult(NamedTuple):
    page_ids: list[int]  # the tree's pages for the inserted path (use these in the block table)
    node: RadixNode  # the deepest node of the path
    duplicates: list[int]  # caller pages not adopted because the tree already held that block


class RadixCache:
    """Page-granular radix tree with lock counts and LRU eviction of unlocked leaves."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.page_size = page_size
        self._roots: dict[str, RadixNode] = {DEFAULT_SALT: RadixNode((), -1, None, DEFAULT_SALT)}
        self._leaves: set[RadixNode] = set()  # non-root nodes without children
        # eviction candidates by (last_access, tie); entries go stale and are skipped when popped
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._tie = itertools.count()
        self._clock = 0
        self.num_pages = 0  # pages held by the tree
        self.num_locked = 0  # of those, pages with lock_ref > 0
        self.num_evicted = 0  # pages evicted over the cache's life

    # ---- queries -------------------------------------------------------------------------------------

    @property
    def num_evictable(self) -> int:
        """Cached pages no request holds: they count as free capacity."""
        return self.num_pages - self.num_locked

    def root(self, salt: str | None = None) -> RadixNode:
        """The root for `salt`, created on first use."""
        salt = salt or DEFAULT_SALT
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = RadixNode((), -1, None, salt)
        return node

    def _blocks(self, tokens: Sequence[int], num_pages: int) -> Iterator[tuple[int, ...]]:
        ps = self.page_size
        for i in range(num_pages):
            yield tuple(tokens[i * ps:(i + 1) * ps])

    def match_prefix(self, tokens: Sequence[int], salt: str | None = None, touch: bool = True) -> MatchResult:
        """Longest cached whole-page prefix of `tokens` (a partial last page is ignored).

        The caller caps `tokens` (e.g. to prompt_len - 1) before calling. `touch` refreshes the LRU time of
        the matched path; pass False for a peek that must not disturb eviction order.
        """
        node = self._roots.get(salt or DEFAULT_SALT)
        if node is None:  # an unseen salt: a detached empty root, registered only by a later insert
            return MatchResult([], RadixNode((), -1, None, salt or DEFAULT_SALT))
        pages: list[int] = []
        if touch:
            self._clock += 1
        for key in self._blocks(tokens, len(tokens) // self.page_size):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            if touch:
                node.last_access = self._clock
            pages.append(node.page_id)
        if touch:
            self._offer(node)
        return MatchResult(pages, node)

    # ---- updates -------------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], page_ids: Sequence[int], salt: str | None = None,
               start: RadixNode | None = None) -> InsertResult:
        """Cache the full pages of `tokens` whose KV sits in `page_ids` (one id per full page).

        Blocks already in the tree keep the tree's page; the caller's page for such a block is returned in
        `duplicates` (unless it is that very page) for the caller to free or keep privately. `start`, an
        attached node whose path is the first `start.depth` pages of `tokens` (e.g. the caller's locked
        node), skips re-walking those blocks; the result is the same.
        """
        num_pages = len(tokens) // self.page_size
        if len(page_ids) < num_pages:
            raise ValueError(f"{len(page_ids)} page ids for {num_pages} full pages")
        self._clock += 1
        path: list[int] = []
        if start is None or start.is_root:
            node, first = self.root(salt), 0
        else:
            if start.parent is None or start.salt != (salt or DEFAULT_SALT) or start.depth > num_pages:
                raise ValueError(f"start node {start} is not on the path of these tokens")
            node, first = start, start.depth
            while not node.is_root:  # touch the path above, as a walk from the root would
                node.last_access = self._clock
                path.append(node.page_id)
                node = node.parent  # type: ignore[assignment]
            path.reverse()
            node = start
        duplicates: list[int] = []
        ps = self.page_size
        for i in range(first, num_pages):
            key = tuple(tokens[i * ps:(i + 1) * ps])
            child = node.children.get(key)
            if child is None:
                child = RadixNode(key, int(page_ids[i]), node, node.salt)
                node.children[key] = child
                self._leaves.discard(node)
                self._leaves.add(child)
                self.num_pages += 1
            elif child.page_id != page_ids[i]:
                duplicates.append(int(page_ids[i]))
            node = child
            node.last_access = self._clock
            path.append(node.page_id)
        self._offer(node)
        return InsertResult(path, node, duplicates)

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and all its ancestors from eviction (counted; pair with `unlock`)."""
        while not node.is_root:
            if node.lock_ref == 0:
                self.num_locked += 1
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def extend_lock(self, held: RadixNode, node: RadixNode) -> None:
        """Move a lock from `held` down to its descendant `node`: lock(node) then unlock(held), walking only
        the path between them (a request caching new pages below the node it holds)."""
        if held.is_root:
            self.lock(node)
            return
        segment = []
        n = node
        while n is not held:
            if n.is_root or n.depth <= held.depth:
                raise ValueError(f"{node} is not below {held}")
            segment.append(n)
            n = n.parent  # type: ignore[assignment]
        for n in segment:
            if n.lock_ref == 0:
                self.num_locked += 1
            n.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        """Release one lock taken with `lock(node)`."""
        start = node
        while not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_locked -= 1
            node = node.parent  # type: ignore[assignment]
        self._offer(start)

    def _offer(self, node: RadixNode) -> None:
        """Queue `node` as an eviction candidate if it is an unlocked leaf (only the deepest node of a path
        touched, unlocked or bared by an eviction can have become one)."""
        if node.is_root or node.children or node.lock_ref:
            return
        heapq.heappush(self._heap, (node.last_access, next(self._tie), node))
        if len(self._heap) > 2 * len(self._leaves) + 1024:  # mostly stale: rebuild from the leaves
            self._heap = [(n.last_access, next(self._tie), n) for n in self._leaves if n.lock_ref == 0]
            heapq.heapify(self._heap)

    def evict(self, num_pages: int) -> list[int]:
        """Remove up to `num_pages` unlocked leaves, least recently used first; return their page ids."""
        if num_pages <= 0:
            return []
        freed: list[int] = []
        while self._heap and len(freed) < num_pages:
            access, _, node = heapq.heappop(self._heap)
            parent = node.parent
            if parent is None or node.children or node.lock_ref or node.last_access != access:
                continue  # stale entry: evicted, grown, locked or touched since it was queued
            del parent.children[node.key]
            self._leaves.discard(node)
            self.num_pages -= 1
            freed.append(node.page_id)
            node.parent = None
            if parent.children:
                continue
            if parent.is_root:
                if parent.salt != DEFAULT_SALT:
                    del self._roots[parent.salt]
                continue
            self._leaves.add(parent)
            self._offer(parent)
        self.num_evicted += len(freed)
        return freed

    # ---- checks --------------------------------------------------------------------------------------

    def nodes(self) -> Iterator[RadixNode]:
        """Every non-root node, depth first."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                yield child
                stack.append(child)

    def page_ids(self) -> list[int]:
        """All pages held by the tree."""
        return [n.page_id for n in self.nodes()]

    def integrity_check(self) -> None:
        """Assert counters, leaf set, lock monotonicity (parent >= sum of children) and unique pages."""
        nodes = list(self.nodes())
        assert len(nodes) == self.num_pages, f"tree holds {len(nodes)} nodes, counter says {self.num_pages}"
        pages = [n.page_id for n in nodes]
        assert len(set(pages)) == len(pages), "a page appears twice in the tree"
        assert all(p > 0 for p in pages), "the tree holds page 0 or a root id"
        assert sum(n.lock_ref > 0 for n in nodes) == self.num_locked, "locked-page counter is off"
        assert {n for n in nodes if not n.children} == self._leaves, "leaf set is off"
        queued = {id(n) for access, _, n in self._heap if n.last_access == access}
        assert all(id(n) in queued for n in self._leaves if n.lock_ref == 0), "an evictable leaf is not queued"
        for n in nodes:
            assert n.parent is not None and n.parent.children.get(n.key) is n, f"{n} is detached"
            assert len(n.key) == self.page_size, f"{n} key is not one full page"
            children_locks = sum(c.lock_ref for c in n.children.values())
            assert n.lock_ref >= children_locks, f"{n} locked less than its children"
            assert n.salt == n.parent.salt, f"{n} crosses salts"
