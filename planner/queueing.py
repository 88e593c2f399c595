"""Queueing formulas the serving model builds on."""

from __future__ import annotations

import math


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with `offered` = lambda * service (Erlang C)."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    inv_b = 1.0  # Erlang B by recursion, then C
    for k in range(1, servers + 1):
        inv_b = 1.0 + inv_b * k / offered
    b = 1.0 / inv_b
    rho = offered / servers
    return b / (1 - rho + rho * b)


def poisson_at_least(k: int, mean: float) -> float:
    """P(N >= k) for N ~ Poisson(mean): the chance that an arrival finds k or more requests in flight."""
    if k <= 0:
        return 1.0
    if mean <= 0:
        return 0.0
    term = total = math.exp(-mean)
    for i in range(1, k):
        term *= mean / i
        total += term
    return max(0.0, 1.0 - total)
