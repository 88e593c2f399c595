"""One step's device inputs: the ragged batch padded to its bucket and packed into one int32 array.

One host-to-device copy a step instead of eight; `StepLayout.unpack` splits it again inside the jit. Sequences
are always padded to `max_num_seqs` (attention loops only over the real ones), so the forward compiles once per
token bucket.

Layout: token ids, positions, slots [T each]; logits indices [R]; cu_q_lens [S+1]; kv_lens [S]; num_seqs,
num_decodes; page table [S * P] (T the token bucket, R the most logits rows a step draws, S `max_num_seqs`, P the
pages of the longest sequence).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.batch import RaggedBatch
from jaxserve.kernels.metadata import AttentionMetadata


@dataclass(frozen=True)
class StepLayout:
    """The packed layout of a runner's steps (see the module doc)."""

    page_size: int
    max_num_seqs: int
    pages_per_seq: int
    max_logits_rows: int

    def _split_points(self, num_tokens: int) -> list[int]:
        """Where the layout's eight parts start (after the first), for `num_tokens` padded tokens."""
        t, n_seq = num_tokens, self.max_num_seqs
        return list(itertools.accumulate((t, t, t, self.max_logits_rows, n_seq + 1, n_seq, 2)))

    def pack(self, batch: RaggedBatch, num_tokens: int) -> np.ndarray:
        """`batch` padded to `num_tokens` tokens and `max_num_seqs` sequences, as one host int32 array; padded
        tokens write their KV into the trash page 0."""
        t, s = batch.num_tokens, batch.num_seqs
        n_seq, n_page = self.max_num_seqs, self.pages_per_seq
        packed = np.zeros(3 * num_tokens + 2 * n_seq + self.max_logits_rows + 3 + n_seq * n_page, np.int32)
        bounds = [0, *self._split_points(num_tokens), packed.shape[0]]
        # views by slicing: np.split's generic path costs more than the rest of the layout, every step
        tok, pos, slots, idx, cu, kv_lens, counts, table = (packed[a:b] for a, b in itertools.pairwise(bounds))
        tok[:t] = batch.token_ids
        pos[:t] = batch.positions
        slots[:] = np.arange(num_tokens, dtype=np.int32) % self.page_size
        slots[:t] = batch.slot_mapping
        idx[: len(batch.logits_indices)] = batch.logits_indices
        cu[:] = t
        cu[: s + 1] = batch.cu_q_lens
        kv_lens[:s] = batch.kv_lens
        counts[:] = (s, batch.num_decodes)
        table.reshape(n_seq, n_page)[:s, : batch.page_table.shape[1]] = batch.page_table
        return packed

    def unpack(self, packed: jax.Array) -> tuple[jax.Array, jax.Array, AttentionMetadata, jax.Array]:
        """(token ids, positions, metadata, logits indices) from `pack`'s array, inside a jit."""
        n_seq, n_page = self.max_num_seqs, self.pages_per_seq
        t = (packed.shape[0] - 2 * n_seq - self.max_logits_rows - 3 - n_seq * n_page) // 3
        tok, pos, slots, idx, cu, kv_lens, counts, table = jnp.split(packed, self._split_points(t))
        meta = AttentionMetadata(slot_mapping=slots, cu_q_lens=cu, kv_lens=kv_lens,
                                 page_table=table.reshape(n_seq, n_page), num_seqs=counts[0], num_decodes=counts[1])
        return tok, pos, meta, idx
