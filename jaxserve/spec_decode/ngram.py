"""N-gram prompt lookup (vLLM's "ngram" method): no model, the sequence proposes its own continuation.

The longest suffix of the sequence, from `prompt_lookup_max` down to `prompt_lookup_min` tokens, that also occurs
earlier proposes the (up to) k tokens that followed its most recent earlier occurrence. A copy-from-prompt task
(repeat or edit a passage) is then accepted in runs of k.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# Only this many most recent tokens are searched: the lookup stays O(window) per step whatever the context.
SEARCH_WINDOW = 4096


def ngram_propose(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int,
                  window: int = SEARCH_WINDOW) -> list[int]:
    """Up to `k` tokens continuing `tokens` by the longest matching earlier n-gram (min_n <= n <= max_n); [] when
    none matches. Among matches of the longest n the most recent occurrence wins."""
    seq = np.asarray(tokens[-window:], dtype=np.int64)
    size = seq.shape[0]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = seq[size - n:]
        # occurrences starting at i with i + n < size: each has at least one token after it
        windows = sliding_window_view(seq[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start: start + k].tolist()
    return []


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
