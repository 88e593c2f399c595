"""The one ragged batch format that goes from the scheduler to the jitted step.

Sequences are ordered decodes first, then prefill chunks. All arrays are host numpy, unpadded; the model
runner pads them into its bucket shapes. Token t of sequence s sits at flat index cu_q_lens[s] + i with
position kv_lens[s] - q_len[s] + i; its KV goes to slot slot_mapping[t] = page * page_size + offset.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from jaxserve.core.request import Request


# Under asynchronous scheduling a decode's newest token may still be on the device: its id is then a placeholder,
# -(s + 1) for what sequence s of the step in flight draws. These three functions are the whole convention; they
# take ints or arrays (numpy or jax) alike.
def placeholder(seq: int) -> int:
    """The token id standing for what sequence `seq` of the step in flight draws."""
    return -(seq + 1)


def is_placeholder(token_id):  # int or array -> bool or bool array
    """Whether a token id (or each id of an array) is a placeholder rather than a real token."""
    return token_id < 0


def placeholder_seq(token_id):  # int or array -> int or int array
    """The sequence index of the step in flight a placeholder stands for."""
    return -token_id - 1


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
    logits_indices: np.ndarray  # [R] int32, flat index of each sequence's last token (R = S), or of each of its
    # 1 + num_drafts[s] last tokens when speculative decoding verifies drafts (R = S + sum(num_drafts))
    samples: np.ndarray  # [S] bool, whether the sequence draws a token this step
    num_drafts: np.ndarray | None = None  # [S] int32, proposed tokens verified after the last real one

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

    Each request must already hold pages for `num_computed_tokens + num_new_tokens` tokens. Tokens past a
    request's own are its `spec_token_ids` (a verify chunk: the last token and the drafts after it).
    """
    num_seqs = len(scheduled)
    q_lens = np.fromiter((n for _, n in scheduled), dtype=np.int32, count=num_seqs)
    starts = np.fromiter((r.num_computed_tokens for r, _ in scheduled), dtype=np.int32, count=num_seqs)
    num_pages = np.fromiter((len(r.page_ids) for r, _ in scheduled), dtype=np.int32, count=num_seqs)
    kv_lens = starts + q_lens
    for s in np.flatnonzero(num_pages * page_size < kv_lens):
        req = scheduled[s][0]
        raise ValueError(f"request {req.request_id} holds {len(req.page_ids)} pages for {kv_lens[s]} tokens")
    cu = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    own = np.fromiter((r.num_tokens for r, _ in scheduled), dtype=np.int32, count=num_seqs)
    drafts = np.maximum(kv_lens - own, 0).astype(np.int32)
    tokens: list[int] = []
    for (req, _), start, end, d in zip(scheduled, starts.tolist(), kv_lens.tolist(), drafts.tolist(), strict=True):
        tokens += _token_slice(req, start, end - d) + req.spec_token_ids[:d]
    token_ids = np.array(tokens, dtype=np.int32)
    page_table = np.zeros((num_seqs, max(1, int(num_pages.max(initial=0)))), dtype=np.int32)
    page_table[np.arange(page_table.shape[1]) < num_pages[:, None]] = np.fromiter(
        itertools.chain.from_iterable(r.page_ids for r, _ in scheduled), dtype=np.int32, count=int(num_pages.sum()))
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
    positions = (np.arange(int(cu[-1]), dtype=np.int32) - cu[seq_of_token] + starts[seq_of_token]).astype(np.int32)
    slot_mapping = page_table[seq_of_token, positions // page_size] * page_size + positions % page_size
    logits = cu[1:] - 1
    if drafts.any():
        logits = np.concatenate([np.arange(e - d - 1, e) for e, d in zip(cu[1:].tolist(), drafts.tolist(),
                                                                          strict=True)]).astype(np.int32)
    return RaggedBatch(requests=[r for r, _ in scheduled], num_decodes=num_decodes, token_ids=token_ids,
                       positions=positions, cu_q_lens=cu, kv_lens=kv_lens, page_table=page_table,
                       slot_mapping=slot_mapping.astype(np.int32), logits_indices=logits,
                       samples=kv_lens - drafts == own, num_drafts=drafts)


def empty_batch() -> RaggedBatch:
    """A batch of no sequences (warm-up compiles a bucket on it)."""
    z = np.zeros(0, np.int32)
    return RaggedBatch(requests=[], num_decodes=0, token_ids=z, positions=z, cu_q_lens=np.zeros(1, np.int32),
                       kv_lens=z, page_table=np.zeros((0, 1), np.int32), slot_mapping=z, logits_indices=z,
                       samples=np.zeros(0, bool))


def trash_prefill(num_tokens: int, page_size: int, max_seqs: int = 1, max_len: int = 0,
                  q_blocks: tuple[int, ...] = (1,), warm_history: int = 0) -> RaggedBatch:
    """Warm-up work whose KV all lives in the trash page 0.

    One decode, a prefill chunk for each of the smaller sizes of `q_blocks` (the attention backend's, largest
    first) and one prefill of the rest (as many as `max_seqs` and `num_tokens` allow), all after a history of up
    to warm_history tokens that fits in `max_len`: the loops of the bucket's attention run once (decode blocks,
    query blocks, masked and unmasked KV blocks). A loop's first run costs extra (its buffers, its threads),
    which would otherwise land on a request.
    """
    history = max(0, min(warm_history, max_len - num_tokens))
    q_lens = [num_tokens]
    for first in (1, *sorted(q_blocks[1:])):
        if len(q_lens) < max_seqs and q_lens[-1] > first:
            q_lens[-1:] = [first, q_lens[-1] - first]
    decodes = int(len(q_lens) > 1)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    positions = np.concatenate([history + np.arange(q) for q in q_lens]).astype(np.int32)
    n = len(q_lens)
    return RaggedBatch(requests=[None] * n, num_decodes=decodes,  # type: ignore[list-item]
                       token_ids=np.zeros(num_tokens, np.int32), positions=positions, cu_q_lens=cu,
                       kv_lens=np.array([history + q for q in q_lens], np.int32),
                       page_table=np.zeros((n, 1), np.int32),
                       slot_mapping=np.arange(num_tokens, dtype=np.int32) % page_size,
                       logits_indices=cu[1:] - 1, samples=np.ones(n, bool))


def _token_slice(req: Request, start: int, end: int) -> list[int]:
    """req.all_token_ids[start:end] without concatenating the whole prompt and output."""
    p = len(req.prompt_token_ids)
    if end <= p:
        return req.prompt_token_ids[start:end]
    if start >= p:
        return req.output_token_ids[start - p:end - p]
    return req.prompt_token_ids[start:] + req.output_token_ids[: end - p]
