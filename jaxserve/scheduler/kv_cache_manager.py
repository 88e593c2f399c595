"""Which KV pages each request holds: a page allocator plus the radix prefix cache.

A request's block table `req.page_ids` has two parts. The first `num_tree_pages` pages are full pages held by
the radix tree along one path that the request keeps locked (shared, read-only). The rest are private pages
from the free list: the page being filled and pages reserved for this step's tokens. As pages fill, they are
inserted into the tree (prompt and generated tokens alike) and the lock moves down to the new deepest node.
On free (finish, abort or preemption) the computed full pages stay in the tree, unlocked, and the private
remainder goes back to the free list, except for a partial last page: its computed tokens are kept as the
*tail* of the path's deepest node. The next request whose prompt continues that path with those tokens (the
next turn of a conversation, a preempted request coming back) claims the page as its own and computes only
from where the tail ends; the page was nobody else's, so it needs no copy. SGLang and vLLM with pages of 16
recompute those up to 15 tokens every turn. A node keeps one tail, the latest. Unlocked cached pages and
tails count as free capacity: `allocate` evicts them when the free list runs dry, tails first (oldest first,
one page each), then tree pages least recently used first.

Page accounting: free list + cached-unlocked (tree pages and tails) + in-use (locked tree pages + private
pages) == usable pages.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from jaxserve.core.batch import is_placeholder
from jaxserve.core.request import Request
from jaxserve.scheduler.page_allocator import PageAllocator
from jaxserve.scheduler.radix_cache import RadixCache, RadixNode


@dataclass
class _Tail:
    """A partial page's computed tokens after a node's path, and the page holding their KV."""

    tokens: tuple[int, ...]
    page_id: int


@dataclass
class _Holding:
    """The KV a request holds: its locked tree path and how many of its pages lie on that path."""

    req: Request
    node: RadixNode | None = None  # deepest locked node (None without prefix caching)
    num_tree_pages: int = 0
    first_admission: bool = False  # set num_cached_tokens and the query/hit counters


class KVCacheManager:
    """Pages for requests: admission with prefix match, growth, caching of full pages, release."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        """`num_pages` counts the whole device pool including the trash page 0."""
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.tree: RadixCache | None = RadixCache(page_size) if enable_prefix_caching else None
        self._held: dict[str, _Holding] = {}
        # Tails by the node their tokens follow (a salt root by its salt); insertion order is eviction order.
        self._tails: dict[RadixNode | str, _Tail] = {}
        self._num_evicted_tails = 0
        self.num_queried_tokens = 0  # prompt tokens looked up at first admission
        self.num_hit_tokens = 0  # of those, served from the cache

    # ---- capacity ------------------------------------------------------------------------------------

    @property
    def enable_prefix_caching(self) -> bool:
        return self.tree is not None

    @property
    def num_usable_pages(self) -> int:
        return self.allocator.num_usable

    @property
    def num_evictable_pages(self) -> int:
        return 0 if self.tree is None else self.tree.num_evictable + len(self._tails)

    @property
    def num_free_pages(self) -> int:
        """Pages obtainable now: the free list plus unlocked cached pages."""
        return self.allocator.num_free + self.num_evictable_pages

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    @property
    def num_evicted_pages(self) -> int:
        return 0 if self.tree is None else self.tree.num_evicted + self._num_evicted_tails

    def usage(self) -> float:
        """In-use pages / usable pages; cached-but-unlocked pages count as free."""
        return self.num_used_pages / self.num_usable_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens of KV."""
        return -(-num_tokens // self.page_size)

    def holds(self, req: Request) -> bool:
        return req.request_id in self._held

    # ---- request lifecycle ---------------------------------------------------------------------------

    def admit(self, req: Request) -> int:
        """Start holding KV for `req`: lock its longest cached prefix and return the hit in tokens.

        The match is capped at num_tokens - 1 (the last token must be computed for its logits): whole pages from
        the tree, then as many tokens as the matched node's tail shares with the prompt. Sets req.page_ids and
        req.num_computed_tokens; on the first admission also req.num_cached_tokens and the query/hit counters.
        `cancel_admission` undoes it.
        """
        if req.request_id in self._held:
            raise ValueError(f"request {req.request_id} is already admitted")
        holding = self._held[req.request_id] = _Holding(req)
        req.page_ids = []
        req.num_computed_tokens = 0
        # Prompt logprobs need every prompt row computed: such a request reads no cached KV (it still caches its own).
        if self.tree is not None and req.sampling_params.prompt_logprobs is None:
            match = self.tree.match_prefix(req.all_token_ids[: req.num_tokens - 1], req.cache_salt)
            self.tree.lock(match.node)
            holding.node, holding.num_tree_pages = match.node, len(match.page_ids)
            req.page_ids = list(match.page_ids)
            req.num_computed_tokens = len(match.page_ids) * self.page_size
            self._claim_tail(req, match.node)
        if req.num_cached_tokens is None:
            holding.first_admission = True
            req.num_cached_tokens = req.num_computed_tokens
            if self.tree is not None:
                self.num_queried_tokens += req.num_prompt_tokens
                self.num_hit_tokens += req.num_computed_tokens
        return req.num_computed_tokens

    def cancel_admission(self, req: Request) -> None:
        """Undo `admit` for a request that could not be scheduled after all (counters included)."""
        holding = self._held[req.request_id]
        if holding.first_admission:
            if self.tree is not None:
                self.num_queried_tokens -= req.num_prompt_tokens
                self.num_hit_tokens -= req.num_cached_tokens
            req.num_cached_tokens = None
        self.free(req)
        req.num_computed_tokens = 0

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Make `req` hold pages for num_computed_tokens + num_new_tokens tokens.

        Evicts unlocked cached pages when the free list runs dry. Returns False, changing nothing, when even
        that is not enough.
        """
        holding = self._held.get(req.request_id)
        if holding is None:
            holding = self._held[req.request_id] = _Holding(req)
        need = self.pages_for(req.num_computed_tokens + num_new_tokens) - len(req.page_ids)
        if need <= 0:
            return True
        if need > self.num_free_pages:
            return False
        short = need - self.allocator.num_free
        if short > 0:
            short -= self._evict_tails(short)
        if short > 0:
            assert self.tree is not None
            self.allocator.free(self.tree.evict(short))
        req.page_ids.extend(self.allocator.allocate(need))
        return True

    def cache_full_pages(self, req: Request) -> None:
        """Insert the request's newly completed full pages into the tree and move its lock to their end.

        A block that another request cached first keeps the tree's page: the request switches to that page
        (same tokens, same KV) and its own copy goes back to the free list.
        """
        holding = self._held.get(req.request_id)
        if self.tree is None or holding is None:
            return
        num_full = min(req.num_computed_tokens // self.page_size, len(req.page_ids))
        if num_full <= holding.num_tree_pages:
            return
        tokens = req.all_token_ids[: num_full * self.page_size]
        result = self.tree.insert(tokens, req.page_ids[:num_full], req.cache_salt, start=holding.node)
        if result.duplicates:
            self.allocator.free(result.duplicates)
        req.page_ids[:num_full] = result.page_ids
        if holding.node is None:
            self.tree.lock(result.node)
        else:
            self.tree.extend_lock(holding.node, result.node)
        holding.node, holding.num_tree_pages = result.node, num_full

    def trim(self, req: Request) -> None:
        """Free the private pages past `req.num_computed_tokens` (the KV of rejected speculative tokens)."""
        holding = self._held.get(req.request_id)
        if holding is None:
            return
        keep = max(self.pages_for(req.num_computed_tokens), holding.num_tree_pages)
        if len(req.page_ids) > keep:
            self.allocator.free(req.page_ids[keep:])
            del req.page_ids[keep:]

    def free(self, req: Request) -> None:
        """Release everything `req` holds: computed full pages stay cached (unlocked), a partial last page's
        computed tokens become its path's tail, the rest is freed.

        Safe to call for a request that holds nothing. Leaves req.num_computed_tokens as it was.
        """
        if req.request_id not in self._held:
            req.page_ids = []
            return
        self.cache_full_pages(req)
        holding = self._held.pop(req.request_id)
        private = req.page_ids[holding.num_tree_pages:]
        if self._keep_tail(req, holding):
            private = private[1:]
        self.allocator.free(private)
        if self.tree is not None and holding.node is not None:
            self.tree.unlock(holding.node)
        req.page_ids = []

    def reset_prefix_cache(self) -> int:
        """Evict every unlocked cached page (e.g. between benchmark runs); return how many."""
        if self.tree is None:
            return 0
        tails = self._evict_tails(len(self._tails))
        freed = self.tree.evict(self.tree.num_evictable)
        self.allocator.free(freed)
        return tails + len(freed)

    # ---- tails ---------------------------------------------------------------------------------------

    def _tail_key(self, node: RadixNode) -> RadixNode | str:
        return node.salt if node.is_root else node

    def _keep_tail(self, req: Request, holding: _Holding) -> bool:
        """Make the computed part of `req`'s partial last page its path's tail; False when there is none.

        Needs every full page in the tree (the tail's key is the path's deepest node) and real token ids (under
        asynchronous scheduling a token still in flight is a negative placeholder).
        """
        n = req.num_computed_tokens
        rest = n % self.page_size
        if (self.tree is None or holding.node is None or rest == 0 or n // self.page_size != holding.num_tree_pages
                or len(req.page_ids) <= holding.num_tree_pages):
            return False
        tokens = tuple(req.all_token_ids[n - rest: n])
        if any(is_placeholder(t) for t in tokens):
            return False
        key = self._tail_key(holding.node)
        old = self._tails.pop(key, None)
        if old is not None:
            self.allocator.free([old.page_id])
        self._tails[key] = _Tail(tokens, req.page_ids[holding.num_tree_pages])
        return True

    def _claim_tail(self, req: Request, node: RadixNode) -> None:
        """Take `node`'s tail for `req` (just matched up to `node`) when it continues the prompt (capped at
        num_tokens - 1): the page becomes the request's first private page, its shared tokens computed."""
        key = self._tail_key(node)
        tail = self._tails.get(key)
        if tail is None:
            return
        want = req.all_token_ids[req.num_computed_tokens: req.num_tokens - 1]
        shared = 0
        for a, b in zip(tail.tokens, want, strict=False):
            if a != b:
                break
            shared += 1
        if shared == 0:
            return
        del self._tails[key]
        req.page_ids.append(tail.page_id)
        req.num_computed_tokens += shared

    def _evict_tails(self, num_pages: int) -> int:
        """Free up to `num_pages` tails, oldest first; return how many."""
        keys = list(itertools.islice(self._tails, num_pages))
        self.allocator.free([self._tails.pop(k).page_id for k in keys])
        self._num_evicted_tails += len(keys)
        return len(keys)

    # ---- checks --------------------------------------------------------------------------------------

    def integrity_check(self) -> None:
        """Assert free + cached-unlocked + in-use == usable, with every page in exactly one place."""
        self.allocator.integrity_check()
        tree_pages: list[int] = []
        if self.tree is not None:
            self.tree.integrity_check()
            tree_pages = self.tree.page_ids()
        private: list[int] = []
        tails = [t.page_id for t in self._tails.values()]
        for t in self._tails.values():
            assert 0 < len(t.tokens) < self.page_size, f"a tail of {len(t.tokens)} tokens is not a partial page"
        expected_locks: Counter[int] = Counter()
        for rid, h in self._held.items():
            assert h.req.request_id == rid, f"holding for {rid} points at {h.req.request_id}"
            assert len(h.req.page_ids) >= h.num_tree_pages, f"{rid} has fewer pages than its tree path"
            private.extend(h.req.page_ids[h.num_tree_pages:])
            path: list[int] = []
            node = h.node
            while node is not None and not node.is_root:
                expected_locks[id(node)] += 1
                path.append(node.page_id)
                node = node.parent
            assert path[::-1] == h.req.page_ids[: h.num_tree_pages], f"{rid} block table is off its tree path"
        free = self.allocator.free_pages()
        everything = free + tree_pages + private + tails
        assert len(set(everything)) == len(everything), "a page is in two places (free, tree, private, tails)"
        assert set(everything) == set(range(1, self.allocator.num_pages)), "a page is lost or unknown"
        assert set(tree_pages + private + tails) == set(self.allocator.allocated_pages()), "allocator flags are off"
        if self.tree is not None:
            for node in self.tree.nodes():
                assert node.lock_ref == expected_locks[id(node)], f"{node} lock count is not its holders'"
        in_use = (self.tree.num_locked if self.tree is not None else 0) + len(private)
        assert self.allocator.num_free + self.num_evictable_pages + in_use == self.num_usable_pages, (
            "free + cached-unlocked + in-use != usable")
