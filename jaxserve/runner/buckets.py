"""Bucket ladders: the padded sizes a step's tokens, sequences and pages are compiled for.

Every distinct shape of a jitted step is one more compile, so a step pads its token count, its sequence count and
its page count up to the next rung of a short ladder; warm-up compiles every rung once.
"""

from __future__ import annotations


def power_of_two_ladder(limit: int, start: int = 1) -> tuple[int, ...]:
    """start, 2*start, 4*start, ... up to and including `limit`."""
    ladder, b = [], start
    while b < limit:
        ladder.append(b)
        b *= 2
    ladder.append(limit)
    return tuple(ladder)


def half_octave_ladder(limit: int, start: int = 1) -> tuple[int, ...]:
    """Powers of two up to `start`, then 1.5x steps (..., 64, 96, 128, 192, ...) up to and including `limit`.

    Padding a step to its bucket wastes at most a third of its tokens above `start` (half with powers of two):
    a 320-token step runs at 384, not 512. Below `start` a step is too cheap for padding to matter, so the
    ladder stays coarse there and warm-up compiles few variants.
    """
    out, b = [], 1
    while b < limit:
        out += [b] if b < max(2, start) else [b, b * 3 // 2]
        b *= 2
    return tuple(sorted({x for x in out if x < limit} | {limit}))


def default_token_ladder(limit: int) -> tuple[int, ...]:
    """The engine's token buckets when none are configured: powers of two to 16, half-octave steps above
    (16, 24, 32, 48, 64, 96, ...), eighth-octave steps above 256 (..., 256, 288, 320, 352, 384, ..., 512, 576, ...).

    Above ~8 rows a CPU step's matmuls are no longer bound by reading the weights, so padded rows cost time;
    above 256 a prefill step is compute-bound and every padded token costs as much as a real one. Each bucket is
    one more compile at start-up. See docs/tuning.md."""
    out = {b for b in half_octave_ladder(limit, start=16) if b <= 256}
    b = 256
    while b < limit:
        out |= {b * k // 8 for k in range(8, 16) if b * k // 8 < limit}
        b *= 2
    return tuple(sorted(out | {limit}))


def bucket_for(n: int, ladder: tuple[int, ...]) -> int:
    """Smallest bucket that holds `n`."""
    for b in ladder:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {ladder[-1]}")


def speculative_round_sizes(seq_buckets: tuple[int, ...], k: int, max_rows: int) -> tuple[int, ...]:
    """The sequence buckets S a fused speculative round of k drafts a sequence runs in: its forward and its logits
    take S (k + 1) rows, at most `max_rows` (the widest token bucket, the logits rows held)."""
    return tuple(s for s in seq_buckets if s * (k + 1) <= max_rows)
