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
from flax import nnx

from jaxserve.core.batch import RaggedBatch
from jaxserve.runner.model_runner import ModelRunner, bucket_for, power_of_two_ladder
from jaxserve.runner.parallel import params_shardings, replicated
from jaxserve.runner.sampler import NUM_TOP_LOGPROBS, SamplingArrays
from jaxserve.spec_decode.rejection import verify


@dataclass
class VerifyResult:
    """Host copies, one entry per logits row of the batch."""

    accepted: np.ndarray  # [R] bool: the row's draft token was accepted
    tokens: np.ndarray  # [R] int32: the accepted draft, else the row's own draw
    logprobs: np.ndarray  # [R] float32, of `tokens` under the target's unscaled distribution
    top_ids: np.ndarray | None  # [R, K] when logprobs were asked for
    top_logprobs: np.ndarray | None


def _verify_impl(runner: ModelRunner, point_mass: bool, param_leaves, hidden_rows, temperature, top_k, top_p, min_p,
                 seed, step, draft, q_index, q_flat, want_logprobs):
    model = nnx.merge(runner.graphdef, jax.tree.unflatten(runner._param_tree, param_leaves))
    logits = model.compute_logits(hidden_rows[: temperature.shape[0]], cpu_kernel=runner.cpu_kernels,
                                  plan=runner.kernel_plan)
    q = None if point_mass else q_flat[q_index]
    accepted, tokens = verify(logits, temperature, top_k, top_p, min_p, seed, step, draft, q)
    lse = jax.nn.logsumexp(logits, axis=-1)
    token_lp = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    k = min(NUM_TOP_LOGPROBS, logits.shape[-1])
    top_lp, top_ids = jax.lax.cond(
        want_logprobs, lambda: tuple(jax.lax.top_k(logits - lse[:, None], k)),
        lambda: (jnp.zeros((logits.shape[0], k), logits.dtype), jnp.zeros((logits.shape[0], k), jnp.int32)))
    return accepted, tokens, token_lp, top_ids, top_lp


class Verifier:
    """Runs verify steps on the target `ModelRunner` (built with `max_logits_rows` = max_num_seqs x (k + 1))."""

    def __init__(self, runner: ModelRunner, k: int, point_mass: bool, vocab_size: int) -> None:
        self.runner, self.k, self.point_mass, self.vocab_size = runner, k, point_mass, vocab_size
        # Powers of two, and (k + 1) rows per sequence for each sequence bucket: a batch whose every sequence
        # verifies k drafts draws from no padded row.
        self.row_buckets = tuple(sorted(set(power_of_two_ladder(runner.max_logits_rows)) | {
            (k + 1) * b for b in runner.seq_buckets if (k + 1) * b <= runner.max_logits_rows}))
        # q rows of the draft model: k arrays of max_sampled rows, flattened (shape fixed: one compile per bucket).
        self.q_rows = k * runner.max_sampled
        fn = functools.partial(_verify_impl, runner, point_mass)
        if runner.mesh is None:
            self._fn = jax.jit(fn)
        else:
            rep = replicated(runner.mesh)
            self._fn = jax.jit(fn, in_shardings=(jax.tree.leaves(params_shardings(runner.params)), *(rep,) * 11),
                               out_shardings=rep)

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
        r = self.runner
        t = bucket_for(batch.num_tokens, r.token_buckets)
        hidden, r.kv_caches = r._forward_for(t)(r.param_leaves, r.kv_caches, r._device_inputs(batch, t), r._no_prev)
        out = self._call(hidden, sampling, drafts, q_index, q_flat)
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
        rows = r._put((sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.seed,
                       sampling.step, drafts, q_index))
        return self._fn(r.param_leaves, hidden, *rows, q_flat, np.bool_(sampling.want_logprobs))

    def _no_q(self, hidden) -> Any:
        """The q argument of point-mass proposals (never read) or of a step without draft rows (zeros)."""
        if not hasattr(self, "_zeros_q"):
            shape = (1, 1) if self.point_mass else (self.q_rows, self.vocab_size)
            self._zeros_q = jnp.zeros(shape, jnp.float32, device=hidden.sharding)
        return self._zeros_q

    def warmup(self) -> None:
        """Compile every row bucket, on the hidden rows of an empty forward (which writes only the trash page)."""
        r = self.runner
        t = r.token_buckets[0]
        hidden, r.kv_caches = r._forward_for(t)(r.param_leaves, r.kv_caches, r._device_inputs(empty_batch(), t),
                                                r._no_prev)
        for size in self.row_buckets:
            sampling = SamplingArrays.build([], size)
            sampling.want_logprobs = True
            jax.block_until_ready(self._call(hidden, sampling, np.full(size, -1, np.int32), np.zeros(size, np.int32),
                                             None))

    def compile_count(self) -> int:
        return self._fn._cache_size()


def empty_batch() -> RaggedBatch:
    """A batch of no sequences (warm-up)."""
    z = np.zeros(0, np.int32)
    return RaggedBatch(requests=[], num_decodes=0, token_ids=z, positions=z, cu_q_lens=np.zeros(1, np.int32),
                       kv_lens=z, page_table=np.zeros((0, 1), np.int32), slot_mapping=z, logits_indices=z,
                       samples=np.zeros(0, bool))
