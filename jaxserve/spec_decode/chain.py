"""The next speculative round, laid out while the round before it is still on the device (`--async-scheduling`).

The host does not know yet how many drafts that round accepts, so it lays the next one out as if it accepted
none: each sequence's chunk starts with a placeholder for the round's last token (the carry's, on the device) at
the position after its last token now, its draws' token indices start one past its output now, and its pages
cover the most the round in flight may have accepted. The device moves every linked row on by the drafts actually
accepted (`round.py`). Draft counts are cut so that even a fully accepted round in flight leaves room within
max_tokens and max_model_len. N-gram proposals come from the tokens known, followed by the round in flight's own
drafts as if all were accepted, when lookup on the tokens known now proposes those drafts too (else as if it
accepted none): the first token the lookup then proposes stands for that round's own token, the rest are the next
round's drafts; when the guess is wrong they are rejected, which costs speed, never tokens.
"""

from __future__ import annotations

import itertools

import numpy as np

from jaxserve.core.batch import RaggedBatch, placeholder
from jaxserve.spec_decode.ngram import NgramProposer, ngram_propose


def chain_batch(flight: RaggedBatch, kv, k: int, max_model_len: int, ngram: NgramProposer | None
                ) -> tuple[RaggedBatch, list[int]] | None:
    """The round after `flight` (a round of decodes in flight) for the same sequences in the same order, and each
    sequence's first token index, or None when pages are short (`kv`: the engine's KVCacheManager)."""
    page_size = kv.page_size
    tokens: list[int] = []
    q_lens, starts, drafts, steps = [], [], [], []
    for s, req in enumerate(flight.requests):
        n_prev = int(flight.num_drafts[s])
        last = req.num_tokens  # the round in flight's last token goes here, if it accepts none of its drafts
        out = len(req.output_token_ids) + 1
        room = max(0, min(k, req.max_tokens - out - n_prev - 1, max_model_len - last - n_prev - 2))
        proposal: list[int] = []
        if ngram is not None and room > 0:
            c = int(flight.cu_q_lens[s])
            history, in_flight = req.all_token_ids, flight.token_ids[c + 1: c + 1 + n_prev].tolist()
            # Its drafts were guessed before the round before it was known: if lookup on what is known now would
            # propose them too, they may well be accepted; if not, that round will most likely emit one token.
            if in_flight and ngram_propose(history, n_prev, ngram.min_n, ngram.max_n) == in_flight:
                history = history + in_flight
            proposal = ngram_propose(history, room + 1, ngram.min_n, ngram.max_n)[1:]
        elif ngram is None:
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
    return batch, steps
