"""N-gram prompt lookup (vLLM's "ngram" method): no model, the sequence proposes its own continuation.

The longest suffix of the sequence, from `prompt_lookup_max` down to `prompt_lookup_min` tokens, that also occurs
earlier proposes the (up to) k tokens that followed its most recent earlier occurrence. A copy-from-prompt task
(repeat or edit a passage) is then accepted in runs of k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Only this many most recent tokens are searched: the lookup stays O(window) per step whatever the context.
SEARCH_WINDOW = 4096


# Up to this many earlier occurrences of the newest token are checked one by one in Python (a handful of list
# compares cost less than numpy's calls at a small model's step: docs/speculative.md); a token that occurs more
# often in the window is searched by numpy in one pass, whose cost does not grow with the count.
PYTHON_CANDIDATES = 32


def ngram_propose(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int,
                  window: int = SEARCH_WINDOW) -> list[int]:
    """Up to `k` tokens continuing `tokens` by the longest matching earlier n-gram (min_n <= n <= max_n); [] when
    none matches. Among matches of the longest n the most recent occurrence wins."""
    tail = tokens[-window:]  # a list's slice is already a copy; an array's becomes one list
    seq = tail.tolist() if isinstance(tail, np.ndarray) else tail
    size = len(seq)
    longest = min(max_n, size - 1)
    if longest < max(min_n, 1):
        return []
    ends, last, at = [], seq[-1], -1  # earlier occurrences of the last token (each with a token after it)
    try:
        while len(ends) <= PYTHON_CANDIDATES:
            at = seq.index(last, at + 1, size - 1)
            ends.append(at)
    except ValueError:
        pass
    if len(ends) > PYTHON_CANDIDATES:
        return _propose_in_one_pass(seq, k, min_n, longest)
    best, start = 0, 0
    for end in reversed(ends):  # the most recent first: an older one wins only by matching longer
        n = 1
        while n < longest and end - n >= 0 and seq[end - n] == seq[size - 1 - n]:
            n += 1
        if n > best:
            best, start = n, end + 1
            if n == longest:
                break
    return seq[start: start + k] if best >= max(min_n, 1) else []


def _propose_in_one_pass(tokens: list[int], k: int, min_n: int, longest: int) -> list[int]:
    """`ngram_propose` by numpy: every earlier occurrence of the last token at once, then how far back each keeps
    matching the suffix (one pass over the window and `longest` gathers at the candidates)."""
    seq = np.asarray(tokens, dtype=np.int64)
    size = seq.shape[0]
    ends = np.flatnonzero(seq[: size - 1] == seq[-1])
    if not ends.size:
        return []
    length = np.ones(ends.shape[0], np.int64)
    matching = np.ones(ends.shape[0], bool)
    for m in range(1, longest):
        before = ends - m
        matching &= (before >= 0) & (seq[np.maximum(before, 0)] == seq[size - 1 - m])
        length += matching
    n = int(length.max())
    if n < min_n:
        return []
    start = int(ends[np.flatnonzero(length == n)[-1]]) + 1  # the most recent of the longest
    return tokens[start: start + k]


class NgramProposer:
    """Proposals for the decoding requests of the next step, from their own tokens (host, before scheduling)."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def prepare(self, requests: list, max_model_len: int) -> None:
        """Set each decoding request's `spec_token_ids` (at most what its max_tokens and max_model_len leave)."""
        for req in requests:
            room = draft_room(req, self.k, max_model_len)
            req.spec_token_ids = (ngram_propose(req.all_token_ids, room, self.min_n, self.max_n)
                                  if room > 0 else [])


def draft_room(req, k: int, max_model_len: int) -> int:
    """Drafts a decoding request may verify this step: a verify step emits up to drafts + 1 tokens, all within
    max_tokens and max_model_len; 0 for a request that is not decoding."""
    if req.num_tokens_owed != 1:
        return 0
    return max(0, min(k, req.max_tokens - len(req.output_token_ids) - 1, max_model_len - req.num_tokens - 1))


# The tokens a chained round's lookup on the device searches (`lookup_on_device`): the host sends each sequence's
# newest DEVICE_WINDOW tokens a round.
DEVICE_WINDOW = 512


def lookup_on_device(window: jax.Array, drafts: jax.Array, accepted: jax.Array, last: jax.Array, room: jax.Array,
                     k: int, min_n: int, max_n: int) -> tuple[jax.Array, jax.Array]:
    """`ngram_propose` of one sequence on the device, once the round before is known: the tokens are `window` (its
    known tokens, right-aligned, -1 before them), then the first `accepted` of that round's `drafts` [k] (-1
    padded), then `last`, its newest token. Returns (up to k proposals, which of them are real): at most `room`,
    the same as `ngram_propose(tokens, room, min_n, max_n)` on those tokens (within the window)."""
    w = window.shape[0]
    ext = jnp.concatenate([window, jnp.where(jnp.arange(k) < accepted, drafts, -1), jnp.full((1,), -1, window.dtype)])
    end = w + accepted
    pos = jnp.arange(ext.shape[0])
    ext = jnp.where(pos == end, last, ext)
    suffix = ext[jnp.maximum(end - jnp.arange(max_n), 0)]  # the newest token first
    padded = jnp.concatenate([jnp.full((max_n,), -1, ext.dtype), ext])
    # [L, max_n]: whether the token m before each position matches the one m before the end (static shifts)
    same = jnp.stack([padded[max_n - m: max_n - m + ext.shape[0]] for m in range(max_n)], axis=1) == suffix
    same = same & (suffix >= 0) & (pos < end)[:, None]  # a candidate occurrence has a token after it
    length = jnp.sum(jnp.cumprod(same, axis=1), axis=1)  # how far back each keeps matching
    n = length.max()
    best = jnp.max(jnp.where((length == n) & (n > 0), pos, -1))  # the most recent of the longest
    src = best + 1 + jnp.arange(k)
    real = (n >= max(min_n, 1)) & (src <= end) & (jnp.arange(k) < room)
    return jnp.where(real, ext[jnp.clip(src, 0, ext.shape[0] - 1)], 0), real


def device_window(tokens: list[int], out: np.ndarray) -> None:
    """Write the newest tokens right-aligned into `out` [DEVICE_WINDOW] (-1 before them): a lookup's host input."""
    tail = tokens[-out.shape[0]:]
    out[: out.shape[0] - len(tail)] = -1
    out[out.shape[0] - len(tail):] = tail
