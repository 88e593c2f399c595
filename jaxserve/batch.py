"""The one ragged batch format that goes from the scheduler to the jitted step.

Sequences are ordered decodes first, then prefill chunks. All arrays are host numpy, unpadded; the model
runner pads them into its bucket shapes. Token t of sequence s sits at flat index cu_q_lens[s] + i with
position kv_lens[s] - q_len[s] + i; its KV goes to slot slot_mapping[t] = page * page_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.request import Request


@dataclass
class RaggedBatch:
    """One engine step's work."""

    requests: list[Request]  # S sequences, decodes first
    num_decodes: int
    token_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    cu_q_lens: np.ndarray  # [S+1] int32, query starts into the flat token arrays
    kv_lens: np.ndarray  # [S] int32, context length including this step's tokens
    page_table: np.ndarray  # [S, max_pages] int32, unused entries 0 (the trash page)
    slot_mapping: np.ndarray  # [T] int32
    logits_indices: np.ndarray  # [S] int32, flat index of each sequence's last token
    samples: np.ndarray  # [S] bool, whether the sequence draws a token this step

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.requests)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes


def build_ragged_batch(scheduled: list[tuple[Request, int]], num_decodes: int, page_size: int) -> RaggedBatch:
    """Lay out `(request, num_new_tokens)` pairs (decodes first) as flat arrays.

    Each request must already hold pages for `num_computed_tokens + num_new_tokens` tokens.
    """
    q_lens = np.array([n for _, n in scheduled], dtype=np.int32)
    cu = np.zeros(len(scheduled) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    total = int(cu[-1])
    token_ids = np.empty(total, dtype=np.int32)
    positions = np.empty(total, dtype=np.int32)
    slot_mapping = np.empty(total, dtype=np.int32)
    kv_lens = np.empty(len(scheduled), dtype=np.int32)
    samples = np.empty(len(scheduled), dtype=bool)
    max_pages = max((len(r.page_ids) for r, _ in scheduled), default=1)
    page_table = np.zeros((len(scheduled), max(1, max_pages)), dtype=np.int32)
    for s, (req, n) in enumerate(scheduled):
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        if len(req.page_ids) * page_size < end:
            raise ValueError(f"request {req.request_id} holds {len(req.page_ids)} pages for {end} tokens")
        lo, hi = int(cu[s]), int(cu[s + 1])
        token_ids[lo:hi] = req.all_token_ids[start:end]
        pos = np.arange(start, end, dtype=np.int32)
        positions[lo:hi] = pos
        pages = np.asarray(req.page_ids, dtype=np.int32)
        slot_mapping[lo:hi] = pages[pos // page_size] * page_size + pos % page_size
        kv_lens[s] = end
        samples[s] = end == req.num_tokens
        page_table[s, : len(pages)] = pages
    return RaggedBatch(requests=[r for r, _ in scheduled], num_decodes=num_decodes, token_ids=token_ids,
                       positions=positions, cu_q_lens=cu, kv_lens=kv_lens, page_table=page_table,
                       slot_mapping=slot_mapping, logits_indices=cu[1:] - 1, samples=samples)
