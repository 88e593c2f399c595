"""N-gram prompt lookup (vLLM's "ngram" method): no model, the sequence proposes its own continuation.

The longest suffix of the sequence, from `prompt_lookup_max` down to `prompt_lookup_min` tokens, that also occurs
earlier proposes the (up to) k tokens that followed its most recent earlier occurrence. A copy-from-prompt task
(repeat or edit a passage) is then accepted in runs of k.
"""

from __future__ import annotations

import numpy as np

# Only this many most recent tokens are searched: the lookup stays O(window) per step whatever the context.
SEARCH_WINDOW = 4096


def ngram_propose(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int,
                  window: int = SEARCH_WINDOW) -> list[int]:
    """Up to `k` tokens continuing `tokens` by the longest matching earlier n-gram (min_n <= n <= max_n); [] when
    none matches. Among matches of the longest n the most recent occurrence wins."""
    seq = np.asarray(tokens[-window:], dtype=np.int64)
    size = seq.shape[0]
    longest = min(max_n, size - 1)
    if longest < max(min_n, 1):
        return []
    # Earlier occurrences of the last token (each with a token after it), then how far back each keeps matching
    # the suffix: one pass over the window and max_n gathers at the candidates (a sliding-window comparison per n
    # cost a visible share of a small model's CPU step; docs/speculative.md).
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
    return seq[start: start + k].tolist()


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
