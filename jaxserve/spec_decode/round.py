"""A whole speculative round in one dispatch, where the shapes allow it: every sequence of the batch decodes
(a verify chunk of its last token and its drafts, or a plain decode).

One jitted call runs, on the device: for a draft model, its forward over each sequence's newest token (after the
accepted draft it never fed, when there is one), its k draws (`draft.propose_draws`), then the target's forward
over the verify chunks, whose draft rows are placeholders the draws fill on the device; for n-gram lookup, whose
proposals the host knows, the target's forward over the chunks as scheduled. Then the logits of every row and the
rejection sampler (`rejection.verify`): each row's draft is the chunk's next token, read on the device. The host
reads one small result a round: each row's acceptance, emitted token and logprob.

Shapes are fixed per sequence bucket S: the target's forward pads to the token bucket of S x (k + 1) rows, the
draft's to that of 2 S, its draws to S rows; so a round compiles once per (S, sampler tier) at warm-up. KV
rollback stays as it is in the loop: a rejected row's KV is written, then left past the request's computed length.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.batch import RaggedBatch, empty_batch, is_placeholder, placeholder, placeholder_seq
from jaxserve.runner.buckets import bucket_for
from jaxserve.runner.compiles import compiled_variants
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.parallel import params_shardings
from jaxserve.runner.sampler import TIERS, SamplingArrays, tier_for
from jaxserve.runner.sampling import logprobs_of
from jaxserve.spec_decode.draft import DraftProposer, propose_draws
from jaxserve.spec_decode.rejection import verify
from jaxserve.spec_decode.verify import VerifyResult


def _round_impl(target: ModelRunner, draft: ModelRunner | None, k: int, tier: str, param_t, kv_t, param_d, kv_d,
                verify_in, draft_in):
    """One round: (accepted [R], tokens [R], logprobs [R][, top ids, top logprobs], kv_t, kv_d), R = S (k + 1)."""
    packed, has_draft, q_index, temperature, top_k, top_p, min_p, seed, step = verify_in
    draw, want_top, _ = TIERS[tier]
    q = None
    tok, pos, meta, idx = target.layout.unpack(packed)
    if draft is not None:
        d_packed, first, slots, table, limits, *rows = draft_in
        d_tok, d_pos, d_meta, d_idx = draft.layout.unpack(d_packed)
        hidden, kv_d = draft.model(param_d)(d_tok, d_pos, kv_d, d_meta, draft.policy.ops_for(False))
        t_loop = bucket_for(temperature.shape[0] // (k + 1), draft.token_buckets)
        drafts, q_flat, kv_d = propose_draws(draft, k, t_loop, draw, param_d, kv_d, hidden[d_idx], first, slots,
                                             table, limits, *rows)
        flat = drafts.reshape(-1)  # draft i + 1 of speculating sequence j: flat[i * max_sampled + j]
        tok = jnp.where(is_placeholder(tok), flat[jnp.clip(placeholder_seq(tok), 0, flat.shape[0] - 1)], tok)
        q = q_flat[q_index]
    model = target.model(param_t)
    hidden, kv_t = model(tok, pos, kv_t, meta, target.policy.ops_for(False))
    n = temperature.shape[0]
    logits = model.compute_logits(hidden[idx][:n], target.ops.matmul)
    d = jnp.where(has_draft, tok[jnp.minimum(idx[:n] + 1, tok.shape[0] - 1)], -1)  # a row's draft: the next token
    accepted, tokens = verify(logits, temperature, top_k, top_p, min_p, seed, step, d, q, draw=draw,
                              cut=target.policy.sampler_cut)
    return (accepted, tokens, *logprobs_of(logits, tokens, want_top), kv_t, kv_d)


class FusedRound:
    """Runs decode-only speculative rounds in one dispatch each (see the module doc), compiled per (sequence
    bucket, sampler tier) at warm-up."""

    def __init__(self, target: ModelRunner, k: int, draft: DraftProposer | None) -> None:
        self.target, self.k, self.draft = target, k, draft
        self.sizes = tuple(s for s in target.seq_buckets
                           if s * (k + 1) <= target.max_logits_rows and s * (k + 1) <= target.token_buckets[-1])
        self._fns: dict[tuple[int, str], Any] = {}

    def accepts(self, batch: RaggedBatch) -> bool:
        """Whether `batch` runs as one round: every sequence draws, each on a chunk of its last token and drafts."""
        if not self.sizes or batch.num_seqs > self.sizes[-1] or not np.all(batch.samples):
            return False
        return bool(np.all(np.diff(batch.cu_q_lens) == 1 + batch.num_drafts))

    def _fn(self, size: int, tier: str) -> Any:
        if (size, tier) not in self._fns:
            t, d = self.target, self.draft
            fn = functools.partial(_round_impl, t, None if d is None else d.runner, self.k, tier)
            _, want_top, _ = TIERS[tier]
            num_outputs = 5 if want_top else 3
            if t.mesh is None:
                self._fns[size, tier] = jax.jit(fn, donate_argnums=(1, 3))
            else:
                rep = t.replicated
                kv_t = jax.tree.map(lambda x: x.sharding, t.kv_caches)
                kv_d = jax.tree.map(lambda x: x.sharding, d.runner.kv_caches) if d is not None else rep
                p_d = jax.tree.leaves(params_shardings(d.runner.params)) if d is not None else rep
                self._fns[size, tier] = jax.jit(
                    fn, donate_argnums=(1, 3),
                    in_shardings=(jax.tree.leaves(params_shardings(t.params)), kv_t, p_d, kv_d, rep, rep),
                    out_shardings=(rep,) * num_outputs + (kv_t, kv_d))
        return self._fns[size, tier]

    def execute(self, batch: RaggedBatch, seeds: list[int], live: set[str]) -> VerifyResult:
        """Run one round of `batch` (`accepts` it); its draft rows' tokens come from the draft model on the device
        (a draft model) or are the proposals it holds (n-gram)."""
        t, k = self.target, self.k
        size = bucket_for(batch.num_seqs, self.sizes)
        rows, has = [], []
        for s, req in enumerate(batch.requests):
            n = int(batch.num_drafts[s])
            rows += [(req.sampling_params, seeds[s], len(req.output_token_ids) + j) for j in range(n + 1)]
            has += [True] * n + [False]
        sampling = SamplingArrays.build(rows, size * (k + 1))
        has_draft = np.zeros(size * (k + 1), bool)
        has_draft[: len(has)] = has
        q_index = np.zeros(size * (k + 1), np.int32)
        draft_in: tuple = ()
        if self.draft is not None:
            d = self.draft.runner
            first, speculating, starts = self.draft.plan(batch, live, 2 * size)
            q_index[: len(batch.logits_indices)] = self.draft.q_index(batch, speculating)
            _, args = self.draft.draw_inputs(batch, speculating, seeds, starts, size)
            draft_in = (d.layout.pack(first, bucket_for(2 * size, d.token_buckets)), *args)
            batch.token_ids = batch.token_ids.copy()
            for j, s in enumerate(speculating):  # draft i + 1 of j: what the draws write at flat i * max_sampled + j
                c = int(batch.cu_q_lens[s])
                batch.token_ids[c + 1: c + 1 + int(batch.num_drafts[s])] = [
                    placeholder(i * d.max_sampled + j) for i in range(int(batch.num_drafts[s]))]
        verify_in = (t.layout.pack(batch, bucket_for(size * (k + 1), t.token_buckets)), has_draft, q_index,
                     *sampling.rows())
        out = self._call(size, tier_for(sampling), verify_in, draft_in)
        n = len(batch.logits_indices)
        if sampling.want_logprobs:
            return VerifyResult(*(np.asarray(x)[:n] for x in jax.device_get(out)))
        return VerifyResult(*(np.asarray(x)[:n] for x in jax.device_get(out[:3])), None, None)

    def _call(self, size: int, tier: str, verify_in: tuple, draft_in: tuple) -> tuple:
        """Call the round; keep the pools it returns (donated: updated in place)."""
        t, d = self.target, self.draft
        p_d, kv_d = (d.runner.param_leaves, d.runner.kv_caches) if d is not None else ((), ())
        *out, t.kv_caches, kv_d = self._fn(size, tier)(t.param_leaves, t.kv_caches, p_d, kv_d,
                                                        t.put(verify_in), t.put(draft_in))
        if d is not None:
            d.runner.kv_caches = kv_d
        return tuple(out)

    def warmup(self) -> None:
        """Compile (and run once, on no sequence: every write goes to the trash page) each size and tier."""
        t, k = self.target, self.k
        for size in self.sizes:
            rows = size * (k + 1)
            verify_in = (t.layout.pack(empty_batch(), bucket_for(rows, t.token_buckets)), np.zeros(rows, bool),
                         np.zeros(rows, np.int32), *SamplingArrays.build([], rows).rows())
            draft_in: tuple = ()
            if self.draft is not None:
                d = self.draft.runner
                z = np.zeros(size, np.int32)
                draft_in = (d.layout.pack(empty_batch(), bucket_for(2 * size, d.token_buckets)), z,
                            np.zeros((k, size), np.int32), np.zeros((size, d.pages_per_seq), np.int32), z,
                            *SamplingArrays.build([], size).rows())
            for tier, (_, _, processed) in TIERS.items():
                if not processed:
                    jax.block_until_ready(self._call(size, tier, verify_in, draft_in))

    def compile_count(self) -> int:
        return compiled_variants(self._fns.values())
