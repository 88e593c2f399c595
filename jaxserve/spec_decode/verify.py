"""The target's verify step: one forward over the ragged batch (decodes, verify chunks of k + 1 rows, prefill
chunks), logits of every row that draws, and the rejection sampler over them, in one jitted call per row bucket.

The forward is the engine's own (`ModelRunner`, the same compiled token buckets); its hidden rows are the batch's
`logits_indices`: one per drawing sequence, 1 + drafts per verifying one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.batch import RaggedBatch, empty_batch
from jaxserve.runner.buckets import bucket_for, power_of_two_ladder
from jaxserve.runner.compiles import compiled_variants
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.sampler import TIERS, SamplingArrays, tier_for
from jaxserve.runner.sampling import logprobs_of
from jaxserve.spec_decode.rejection import verify


@dataclass
class VerifyResult:
    """Host copies, one entry per logits row of the batch."""

    accepted: np.ndarray  # [R] bool: the row's draft token was accepted
    tokens: np.ndarray  # [R] int32: the accepted draft, else the row's own draw
    logprobs: np.ndarray  # [R] float32, of `tokens` under the target's unscaled distribution
    top_ids: np.ndarray | None  # [R, K] when logprobs were asked for
    top_logprobs: np.ndarray | None
    num_drafts: np.ndarray | None = None  # [S] drafts each sequence verified, where the device chose them


def _verify_impl(runner: ModelRunner, point_mass: bool, tier: str, param_leaves, hidden_rows,
                 temperature, top_k, top_p, min_p, seed, step, draft, q_index, q_flat):
    draw, want_top, _ = TIERS[tier]
    logits = runner.model(param_leaves).compute_logits(hidden_rows[: temperature.shape[0]], runner.ops.matmul)
    q = None if point_mass else q_flat[q_index]
    accepted, tokens = verify(logits, temperature, top_k, top_p, min_p, seed, step, draft, q, draw=draw,
                              cut=runner.policy.sampler_cut)
    return accepted, tokens, *logprobs_of(logits, tokens, want_top)


class Verifier:
    """Runs verify steps on the target `ModelRunner` (built with `max_logits_rows` = max_num_seqs x (k + 1)),
    compiled per row bucket and sampler tier (`sampler.TIERS`, but "processed", which speculation refuses)."""

    def __init__(self, runner: ModelRunner, k: int, point_mass: bool, vocab_size: int) -> None:
        self.runner, self.k, self.point_mass, self.vocab_size = runner, k, point_mass, vocab_size
        # Powers of two, and (k + 1) rows per sequence for each sequence bucket: a batch whose every sequence
        # verifies k drafts draws from no padded row.
        self.row_buckets = tuple(sorted(set(power_of_two_ladder(runner.max_logits_rows)) | {
            (k + 1) * b for b in runner.seq_buckets if (k + 1) * b <= runner.max_logits_rows}))
        # q rows of the draft model: k arrays of max_sampled rows, flattened (shape fixed: one compile per bucket).
        self.q_rows = k * runner.max_sampled
        self._fns: dict[str, Any] = {}
        self._zeros_q: jax.Array | None = None

    def _fn(self, tier: str) -> Any:
        if tier not in self._fns:
            fn = functools.partial(_verify_impl, self.runner, self.point_mass, tier)
            self._fns[tier] = self.runner.jit_step(fn, num_inputs=10, num_outputs=5 if TIERS[tier][1] else 3,
                                                   pool=False)
        return self._fns[tier]

    def rows(self, batch: RaggedBatch, sampling_rows: list[tuple[Any, int, int]], drafts: np.ndarray,
             q_index: np.ndarray) -> tuple[SamplingArrays, np.ndarray, np.ndarray]:
        """The padded per-row inputs: sampling parameters, draft token (-1: none) and q row of each logits row."""
        size = bucket_for(len(sampling_rows), self.row_buckets)
        sampling = SamplingArrays.build(sampling_rows, size)
        d = np.full(size, -1, np.int32)
        d[: len(drafts)] = drafts
        qi = np.zeros(size, np.int32)
        qi[: len(q_index)] = q_index
        return sampling, d, qi

    def execute(self, batch: RaggedBatch, sampling: SamplingArrays, drafts: np.ndarray, q_index: np.ndarray,
                q_flat: Any = None) -> VerifyResult:
        """Forward `batch` on the target (its KV written, rejected rows' included) and verify every row."""
        out = self._call(self.runner.forward(batch), sampling, drafts, q_index, q_flat)
        n = len(batch.logits_indices)
        if sampling.want_logprobs:
            acc, tok, lp, ids, top = jax.device_get(out)
            return VerifyResult(np.asarray(acc)[:n], np.asarray(tok)[:n], np.asarray(lp)[:n], np.asarray(ids)[:n],
                                np.asarray(top)[:n])
        acc, tok, lp = jax.device_get(out[:3])
        return VerifyResult(np.asarray(acc)[:n], np.asarray(tok)[:n], np.asarray(lp)[:n], None, None)

    def _call(self, hidden, sampling: SamplingArrays, drafts: np.ndarray, q_index: np.ndarray, q_flat: Any) -> Any:
        r = self.runner
        if q_flat is None:
            q_flat = self._no_q(hidden)
        rows = r.put((*sampling.rows(), drafts, q_index))
        return self._fn(tier_for(sampling))(r.param_leaves, hidden, *rows, q_flat)

    def _no_q(self, hidden) -> Any:
        """The q argument of point-mass proposals (never read) or of a step without draft rows (zeros)."""
        if self._zeros_q is None:
            shape = (1, 1) if self.point_mass else (self.q_rows, self.vocab_size)
            self._zeros_q = jnp.zeros(shape, jnp.float32, device=hidden.sharding)
        return self._zeros_q

    def warmup(self) -> None:
        """Compile every row bucket and variant, on the hidden rows of an empty forward (which writes only the trash
        page)."""
        r = self.runner
        hidden = r.forward(empty_batch())
        for size in self.row_buckets:
            rows = (*SamplingArrays.build([], size).rows(), np.full(size, -1, np.int32), np.zeros(size, np.int32))
            for tier, (_, _, processed) in TIERS.items():
                if not processed:
                    jax.block_until_ready(self._fn(tier)(r.param_leaves, hidden, *r.put(rows), self._no_q(hidden)))

    def compile_count(self) -> int:
        return compiled_variants(self._fns.values())
