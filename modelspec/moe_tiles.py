"""How the runtime lays out a mixture-of-experts step's expert rows (`jaxserve.model.moe.grouped_experts`), for
the step model to price what runs rather than an ideal grouped GEMM.

A step's T x k (token, expert) rows are grouped by expert into tiles of R rows, each expert's rows padded to whole
tiles. Decode-sized steps (T <= DECODE_TILE_MAX) take R = T: one tile per distinct expert, whose padding rows the
grouped kernels skip. Larger steps take R near the mean rows per expert, and every tile's R rows are computed, so
their expert FLOPs follow the expected tiles, not T x k. R follows the step's bucket; the bucket's padding rows
route to no expert (the runtime masks them), so the tiles follow the real tokens.
"""

from __future__ import annotations

import math

# Decode-sized steps (at most this many tokens) take tiles of T rows: one tile per distinct expert.
DECODE_TILE_MAX = 64
# Larger steps take tiles of about the mean rows per expert, within these bounds (powers of two).
MIN_TILE, MAX_TILE = 64, 256


def tile_rows(num_tokens: int, k: int, num_experts: int) -> int:
    """Rows per tile for a step of `num_tokens` tokens routed to `k` of `num_experts` experts (static)."""
    if num_tokens <= DECODE_TILE_MAX:
        return max(1, num_tokens)
    mean = -(-num_tokens * k // num_experts)
    return min(MAX_TILE, max(MIN_TILE, 1 << (mean - 1).bit_length()))


def expected_tiles(num_tokens: int, k: int, num_experts: int, padded_tokens: int = 0) -> float:
    """Expected tiles of one step under uniform routing: sum over experts of E[ceil(c / R)], c ~ Binomial(T, k/E)
    the expert's rows, i.e. E * sum_j P(c > j R); the normal approximation (continuity-corrected) past decode
    sizes, where it is exact enough and keeps the planner's searches fast. `padded_tokens`: the bucket the step
    runs at, which sets R (`tile_rows`); its padding rows route to no expert."""
    if num_experts <= 0 or num_tokens <= 0:
        return 0.0
    p = min(1.0, k / num_experts)
    r = tile_rows(max(num_tokens, padded_tokens), k, num_experts)
    if r >= num_tokens:  # one tile for every expert with a row (R = T at decode sizes)
        return num_experts * (1.0 - (1.0 - p) ** num_tokens)
    mu, sd = num_tokens * p, math.sqrt(max(num_tokens * p * (1.0 - p), 1e-12))
    per_expert = sum(0.5 * math.erfc((j * r + 0.5 - mu) / (sd * math.sqrt(2.0)))
                     for j in range(-(-num_tokens // r)))
    return num_experts * per_expert
