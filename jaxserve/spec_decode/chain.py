"""The next speculative round, laid out while the round before it is still on the device (`--async-scheduling`).

The host does not know yet how many drafts that round accepts, so it lays the next one out as if it accepted
none: each sequence's chunk starts with a placeholder for the round's last token (the carry's, on the device) at
the position after its last token now, its draws' token indices start one past its output now, and its pages
cover the most the round in flight may have accepted. The device moves every linked row on by the drafts actually
accepted (`round.py`). Draft counts are cut so that even a fully accepted round in flight leaves room within
max_tokens and max_model_len. N-gram proposals are made on the device (`ngram.lookup_on_device`) once the round in
flight is known: the host sends each sequence's newest known tokens and lays out placeholders for as many drafts
as it may verify; the device looks up the continuation of those tokens, the drafts that round accepted and its own
token, as a collected round's lookup would. (A guess on the host, before that round was known, wasted the round
after every partly accepted one.)
"""

from __future__ import annotations

import itertools

import numpy as np

from jaxserve.core.batch import RaggedBatch, placeholder
from jaxserve.spec_decode.ngram import DEVICE_WINDOW, device_window


def chain_batch(flight: RaggedBatch, kv, k: int, max_model_len: int, lookup_rows: tuple[int, int] | None
                ) -> tuple[RaggedBatch, list[int], tuple | None] | None:
    """The round after `flight` (a round of decodes in flight) for the same sequences in the same order, each
    sequence's first token index and, for n-gram (`lookup_rows`: max_num_seqs N and sampled rows M of the round's
    placeholders), the device lookup's inputs (window [M, DEVICE_WINDOW], room [M]); or None when pages are short
    (`kv`: the engine's KVCacheManager)."""
    page_size = kv.page_size
    lookup = None
    if lookup_rows is not None:
        n_seq, m = lookup_rows
        lookup = (np.full((m, DEVICE_WINDOW), -1, np.int32), np.zeros(m, np.int32))
    tokens: list[int] = []
    q_lens, starts, drafts, steps = [], [], [], []
    for s, req in enumerate(flight.requests):
        n_prev = int(flight.num_drafts[s])
        last = req.num_tokens  # the round in flight's last token goes here, if it accepts none of its drafts
        out = len(req.output_token_ids) + 1
        room = max(0, min(k, req.max_tokens - out - n_prev - 1, max_model_len - last - n_prev - 2))
        if lookup is not None:  # the device's lookup fills them: proposal i of sequence s at N + i M + s
            proposal = [placeholder(n_seq + i * m + s) for i in range(room)]
            device_window(req.all_token_ids, lookup[0][s])
            lookup[1][s] = room
        else:
            proposal = [0] * room  # the draft model's, filled on the device
        if not kv.allocate(req, n_prev + len(proposal) + 2):  # from its last computed token on, at most
            return None
        tokens += [placeholder(s)] + proposal
        q_lens.append(1 + len(proposal))
        starts.append(last)
        drafts.append(len(proposal))
        steps.append(out)
    num_seqs = len(flight.requests)
    q = np.array(q_lens, np.int32)
    cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    first = np.array(starts, np.int32)
    num_pages = np.array([len(r.page_ids) for r in flight.requests], np.int32)
    table = np.zeros((num_seqs, max(1, int(num_pages.max(initial=0)))), np.int32)
    table[np.arange(table.shape[1]) < num_pages[:, None]] = np.fromiter(
        itertools.chain.from_iterable(r.page_ids for r in flight.requests), np.int32, int(num_pages.sum()))
    seq = np.repeat(np.arange(num_seqs), q)
    positions = (np.arange(int(cu[-1])) - cu[seq] + first[seq]).astype(np.int32)
    slots = table[seq, positions // page_size] * page_size + positions % page_size
    batch = RaggedBatch(requests=list(flight.requests), num_decodes=0, token_ids=np.array(tokens, np.int32),
                        positions=positions, cu_q_lens=cu, kv_lens=first + q, page_table=table,
                        slot_mapping=slots.astype(np.int32), logits_indices=np.arange(int(cu[-1]), dtype=np.int32),
                        samples=np.ones(num_seqs, bool), num_drafts=np.array(drafts, np.int32))
    return batch, steps, lookup
