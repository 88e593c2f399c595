"""The router's view of its servers, and how it picks one (sglang-router's cache-aware policy, simplified).

Each `Worker` keeps its health, the requests the router has in flight on it (its load), and a bounded index of the
prompt prefixes it was sent (`PrefixIndex`: chained hashes of 64-character blocks, least recently used out first),
which stands for what its prefix cache holds. `choose` picks, among healthy workers not yet tried for this request:
the least loaded one when the loads are out of balance (the busiest more than `balance_abs_threshold` requests
over the idlest); otherwise the one whose index matches most of the prompt's leading blocks, when that is more than
`cache_threshold` of them; otherwise the least loaded (ties: the smallest index, to spread new prefixes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

BLOCK_CHARS = 64


def prefix_blocks(text: str, max_blocks: int = 1024) -> list[int]:
    """Chained hashes of the leading 64-character blocks of `text` (a block's hash names its whole prefix)."""
    out, h = [], 0
    for i in range(0, min(len(text), BLOCK_CHARS * max_blocks), BLOCK_CHARS):
        h = hash((h, text[i:i + BLOCK_CHARS]))
        out.append(h)
    return out


class PrefixIndex:
    """Prefix-block hashes one worker was sent, at most `capacity`, least recently used evicted first."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, blocks: list[int]) -> int:
        """How many leading blocks of `blocks` this index holds."""
        n = 0
        for b in blocks:
            if b not in self.blocks:
                break
            n += 1
        return n

    def insert(self, blocks: list[int]) -> None:
        for b in blocks:
            self.blocks[b] = None
            self.blocks.move_to_end(b)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()


@dataclass
class Worker:
    """One server behind the router."""

    url: str
    role: str = "worker"  # "worker" (plain replica), "prefill" or "decode"
    healthy: bool = True
    load: int = 0  # requests the router has in flight on it
    failures: int = 0  # consecutive failed health checks
    request_failures: int = 0  # consecutive requests it failed (its circuit breaker's count)
    index: PrefixIndex = field(default_factory=PrefixIndex)
    requests: int = 0
    errors: int = 0
    streams: set = field(default_factory=set)  # upstream responses being relayed (closed when it is taken out)

    def mark_dead(self) -> None:
        """Out of rotation until a health check passes; its prefix index is forgotten (a restart has no cache)."""
        self.healthy = False
        self.request_failures = 0
        self.index.clear()


@dataclass(frozen=True)
class Policy:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32


def choose(workers: Iterable[Worker], blocks: list[int], policy: Policy,
           exclude: frozenset[str] | set[str] = frozenset()) -> Worker | None:
    """The worker for a prompt of prefix `blocks` (see module doc); None when no healthy worker is left."""
    live = [w for w in workers if w.healthy and w.url not in exclude]
    if not live:
        return None
    idlest = min(live, key=lambda w: (w.load, len(w.index)))
    if blocks and max(w.load for w in live) - idlest.load <= policy.balance_abs_threshold:
        best = max(live, key=lambda w: (w.index.match(blocks), -w.load))
        if best.index.match(blocks) > policy.cache_threshold * len(blocks):
            idlest = best
    idlest.index.insert(blocks)
    return idlest


def ranked(workers: Iterable[Worker], blocks: list[int], policy: Policy) -> list[Worker]:
    """Every healthy worker, the chosen one first, the rest least loaded first (fallbacks in order)."""
    first = choose(workers, blocks, policy)
    if first is None:
        return []
    rest = sorted((w for w in workers if w.healthy and w is not first), key=lambda w: w.load)
    return [first, *rest]
