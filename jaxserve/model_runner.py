"""Runs one ragged batch on the device: pad to a bucket, one jitted forward, one jitted sample.

The forward is compiled once per token bucket (the sequence axis of the metadata is always padded to
`max_num_seqs`, and attention loops only over the real sequences); logits and sampling are compiled once per
sequence bucket. The KV pool is donated to the forward, so XLA updates it in place. Warm-up compiles every
bucket at start-up; `compile_count()` lets tests assert that nothing compiles afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from jaxserve.batch import RaggedBatch
from jaxserve.model.metadata import AttentionMetadata
from jaxserve.sampler import SamplingArrays, sample_tokens


def power_of_two_ladder(limit: int, start: int = 1) -> tuple[int, ...]:
    """start, 2*start, 4*start, ... up to and including `limit`."""
    ladder, b = [], start
    while b < limit:
        ladder.append(b)
        b *= 2
    ladder.append(limit)
    return tuple(ladder)


def bucket_for(n: int, ladder: tuple[int, ...]) -> int:
    """Smallest bucket that holds `n`."""
    for b in ladder:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {ladder[-1]}")


@dataclass
class StepResult:
    """Host copies of what one step drew, one row per real sequence."""

    tokens: np.ndarray  # [S] int32
    logprobs: np.ndarray  # [S] float32, of the drawn token
    top_ids: np.ndarray | None  # [S, K] when logprobs were asked for
    top_logprobs: np.ndarray | None


class ModelRunner:
    """Owns the parameters, the device KV pool and the compiled step functions."""

    def __init__(self, model: nnx.Module, kv_caches, *, page_size: int, max_model_len: int, max_num_seqs: int,
                 token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...]) -> None:
        self.graphdef, self.params = nnx.split(model)
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.pages_per_seq = math.ceil(max_model_len / page_size)
        self.token_buckets = token_buckets
        self.seq_buckets = seq_buckets
        self._forward = jax.jit(self._forward_impl, donate_argnums=(1,))
        self._sample = jax.jit(self._sample_impl)

    # Jitted bodies -------------------------------------------------------------------------------------------
    def _forward_impl(self, params, kv_caches, token_ids, positions, meta: AttentionMetadata, logits_indices):
        model = nnx.merge(self.graphdef, params)
        hidden, kv_caches = model(token_ids, positions, kv_caches, meta)
        return hidden[logits_indices], kv_caches

    def _sample_impl(self, params, hidden_rows, temperature, top_k, top_p, min_p, seed, step, want_logprobs):
        model = nnx.merge(self.graphdef, params)
        logits = model.compute_logits(hidden_rows[: temperature.shape[0]])
        return sample_tokens(logits, temperature, top_k, top_p, min_p, seed, step, want_logprobs)

    # Host side -----------------------------------------------------------------------------------------------
    def _device_inputs(self, batch: RaggedBatch, num_tokens: int):
        """Pad the ragged batch to `num_tokens` tokens and `max_num_seqs` sequences."""
        t, s = batch.num_tokens, batch.num_seqs
        token_ids = np.zeros(num_tokens, np.int32)
        token_ids[:t] = batch.token_ids
        positions = np.zeros(num_tokens, np.int32)
        positions[:t] = batch.positions
        slots = np.arange(num_tokens, dtype=np.int32) % self.page_size  # padded tokens: trash page 0
        slots[:t] = batch.slot_mapping
        cu = np.full(self.max_num_seqs + 1, t, np.int32)
        cu[: s + 1] = batch.cu_q_lens
        kv_lens = np.zeros(self.max_num_seqs, np.int32)
        kv_lens[:s] = batch.kv_lens
        table = np.zeros((self.max_num_seqs, self.pages_per_seq), np.int32)
        table[:s, : batch.page_table.shape[1]] = batch.page_table
        logits_indices = np.zeros(self.max_num_seqs, np.int32)
        logits_indices[:s] = batch.logits_indices
        meta = AttentionMetadata(slot_mapping=slots, cu_q_lens=cu, kv_lens=kv_lens, page_table=table,
                                 num_seqs=np.int32(s), num_decodes=np.int32(batch.num_decodes))
        return jax.device_put((token_ids, positions, meta, logits_indices))

    def execute(self, batch: RaggedBatch, sampling: SamplingArrays) -> StepResult:
        """Run the forward for every scheduled token and draw one token per sequence."""
        if batch.num_seqs > self.max_num_seqs:
            raise ValueError(f"batch of {batch.num_seqs} sequences exceeds max_num_seqs={self.max_num_seqs}")
        num_tokens = bucket_for(batch.num_tokens, self.token_buckets)
        token_ids, positions, meta, logits_indices = self._device_inputs(batch, num_tokens)
        hidden_rows, self.kv_caches = self._forward(self.params, self.kv_caches, token_ids, positions, meta,
                                                    logits_indices)
        out = self._sample(self.params, hidden_rows, sampling.temperature, sampling.top_k, sampling.top_p,
                           sampling.min_p, sampling.seed, sampling.step, np.bool_(sampling.want_logprobs))
        tokens, logprobs, top_ids, top_lp = jax.device_get(out)
        s = batch.num_seqs
        if not sampling.want_logprobs:
            return StepResult(tokens[:s], logprobs[:s], None, None)
        return StepResult(tokens[:s], logprobs[:s], top_ids[:s], top_lp[:s])

    def sampling_bucket(self, num_seqs: int) -> int:
        return bucket_for(num_seqs, self.seq_buckets)

    def warmup(self) -> None:
        """Compile every token bucket of the forward and every sequence bucket of the sampler."""
        empty = RaggedBatch(requests=[], num_decodes=0, token_ids=np.zeros(0, np.int32),
                            positions=np.zeros(0, np.int32), cu_q_lens=np.zeros(1, np.int32),
                            kv_lens=np.zeros(0, np.int32), page_table=np.zeros((0, 1), np.int32),
                            slot_mapping=np.zeros(0, np.int32), logits_indices=np.zeros(0, np.int32),
                            samples=np.zeros(0, bool))
        hidden_rows = None
        for t in self.token_buckets:
            token_ids, positions, meta, logits_indices = self._device_inputs(empty, t)
            hidden_rows, self.kv_caches = self._forward(self.params, self.kv_caches, token_ids, positions, meta,
                                                        logits_indices)
        for s in self.seq_buckets:
            a = SamplingArrays.build([], s)
            jax.block_until_ready(self._sample(self.params, hidden_rows, a.temperature, a.top_k, a.top_p,
                                               a.min_p, a.seed, a.step, np.bool_(True)))

    def compile_count(self) -> int:
        """Compiled variants of the step functions so far (grows only when a new shape appears)."""
        return self._forward._cache_size() + self._sample._cache_size()

