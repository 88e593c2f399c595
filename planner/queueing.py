"""Queueing formulas the serving model builds on."""

from __future__ import annotations


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
