"""Device-side attention metadata for one padded ragged step (built by the model runner)."""

from __future__ import annotations

from dataclasses import dataclass

import jax


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    """Where each token's KV goes and which KV each sequence reads.

    Shapes are the runner's bucket shapes: T padded tokens, S padded sequences, P pages per sequence.
    Padded tokens write to slots of page 0 (the trash page); padded sequences have q_len 0 and kv_len 0.
    Sequences are ordered decodes (q_len 1) first, then prefill chunks.
    """

    slot_mapping: jax.Array  # [T] int32, page * page_size + offset
    cu_q_lens: jax.Array  # [S+1] int32
    kv_lens: jax.Array  # [S] int32, context length including this step's tokens
    page_table: jax.Array  # [S, P] int32
    num_seqs: jax.Array  # [] int32, real sequences
    num_decodes: jax.Array  # [] int32, leading sequences with exactly one query token

    @property
    def num_tokens(self) -> jax.Array:
        """[] int32: the step's real tokens; the rows after them are the bucket's padding."""
        return self.cu_q_lens[self.num_seqs]
