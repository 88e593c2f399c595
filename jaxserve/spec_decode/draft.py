"""The draft model: a smaller checkpoint of the target's vocabulary that proposes k tokens per sequence.

It runs in the engine's process on the target's mesh with its own parameters and its own KV pool, a mirror of the
target's: as many pages, indexed by the same block tables, so the target's page allocation, prefix cache and
rollback serve both (a page cached in the target's tree holds the draft's KV of the same tokens). Each step, before
the target verifies:

1. one draft forward over the target's batch as scheduled, without its draft rows (decodes, prefill chunks: the
   draft's KV keeps pace with the target's), plus, for a sequence whose previous k drafts were all accepted, the
   last of them (the draft never fed it): logits of the speculating sequences' last rows draw draft 1;
2. k - 1 decode forwards of the speculating sequences, all in one batch each, each feeding the previous draw
   through the runner's placeholder tokens (no host round trip between them);
3. one copy of the k draws to the host, which writes them into the target batch's draft rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.core.batch import RaggedBatch, placeholder
from jaxserve.core.engine_config import EngineConfig
from jaxserve.runner.model_builder import init_sharded_kv_cache, load_model
from jaxserve.runner.model_runner import ModelRunner, bucket_for
from jaxserve.runner.parallel import effective_spec, params_shardings, replicate_kv_heads, replicated, shard_model
from jaxserve.runner.sampler import SamplingArrays
from jaxserve.spec_decode.rejection import sample_draft
from jaxserve.spec_decode.verify import empty_batch
from planner.model_spec import ModelSpec, load_model_spec


def _sample_impl(runner: ModelRunner, param_leaves, hidden_rows, temperature, top_k, top_p, min_p, seed, step):
    """Draft tokens padded to the runner's `max_sampled` (what its forward reads placeholders from) and their
    distributions padded to as many rows."""
    model = nnx.merge(runner.graphdef, jax.tree.unflatten(runner._param_tree, param_leaves))
    rows = temperature.shape[0]
    logits = model.compute_logits(hidden_rows[:rows], cpu_kernel=runner.cpu_kernels, plan=runner.kernel_plan)
    tokens, q = sample_draft(logits, temperature, top_k, top_p, min_p, seed, step)
    n = runner.max_sampled
    return (jnp.zeros(n, jnp.int32).at[:rows].set(tokens),
            jnp.zeros((n, logits.shape[-1]), jnp.float32).at[:rows].set(q.astype(jnp.float32)))


class DraftProposer:
    """Owns the draft model's runner; `propose` fills a scheduled batch's draft rows."""

    def __init__(self, config: EngineConfig, model: str, k: int, target: ModelRunner, target_spec: ModelSpec,
                 num_pages: int, max_model_len: int) -> None:
        spec = load_model_spec(model)
        if spec.vocab_size != target_spec.vocab_size:
            raise ValueError(f"speculative_config: the draft model {model} has a vocabulary of {spec.vocab_size} "
                             f"tokens, the target {target_spec.vocab_size}; they must share one")
        if spec.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config: the draft model {model} holds {spec.max_position_embeddings} "
                             f"positions, fewer than max_model_len {max_model_len}")
        self.k, self.spec = k, spec
        k0 = target.kv_caches[0][0]
        tp = config.tensor_parallel_size
        weights = load_model(dataclasses.replace(config, model=model), spec, k0.dtype, target.mesh)
        replicate_kv_heads(weights, spec, tp)
        shard_model(weights, target.mesh)
        kv = init_sharded_kv_cache(effective_spec(spec, tp), num_pages, config.page_size, k0.dtype, target.mesh)
        self.runner = r = ModelRunner(weights, kv, page_size=config.page_size, max_model_len=max_model_len,
                                      max_num_seqs=config.max_num_seqs, token_buckets=target.token_buckets,
                                      seq_buckets=target.seq_buckets, cpu_kernels=config.cpu_kernels,
                                      attention_backend=target.attention.name)
        fn = functools.partial(_sample_impl, r)
        if r.mesh is None:
            self._sample = jax.jit(fn)
        else:
            rep = replicated(r.mesh)
            self._sample = jax.jit(fn, in_shardings=(jax.tree.leaves(params_shardings(r.params)), *(rep,) * 7),
                                   out_shardings=rep)
        self._no_q: jax.Array | None = None
        self._no_q_all: jax.Array | None = None
        self._lag: dict[str, int] = {}  # request id -> the position of an accepted draft the draft never fed

    # ---- one step ----------------------------------------------------------------------------------

    def propose(self, batch: RaggedBatch, seeds: list[int], live: set[str]) -> tuple[Any, np.ndarray]:
        """Run the draft for `batch` and write its proposals into the draft rows (and `spec_token_ids`) of the
        speculating sequences; returns (q_flat [k * max_sampled, V] on the device, the q row of each logits row)."""
        self._lag = {rid: p for rid, p in self._lag.items() if rid in live}
        r = self.runner
        cu, drafts = batch.cu_q_lens, batch.num_drafts
        q_lens = np.diff(cu)
        starts = batch.kv_lens - q_lens
        items = []  # (sequence, first position, tokens)
        room = r.token_buckets[-1] - int(np.sum(q_lens - drafts))  # lagging tokens the largest bucket still holds
        for s, req in enumerate(batch.requests):
            real = int(q_lens[s] - drafts[s])
            lag = self._lag.pop(req.request_id, -2) == starts[s] - 1
            toks = batch.token_ids[cu[s]: cu[s] + real].tolist()
            if lag and room > 0:  # without room the draft's KV misses that token: its proposals, never outputs, suffer
                toks, room = [_token_at(req, int(starts[s]) - 1)] + toks, room - 1
            items.append((s, int(starts[s]) + real - len(toks), toks))
        items.sort(key=lambda it: len(it[2]) != 1)  # the draft's decodes first, as the batch format wants
        speculating = [s for s, _, _ in items if drafts[s] > 0]
        first = self._batch(batch, items, speculating)
        t = bucket_for(first.num_tokens, r.token_buckets)
        hidden, r.kv_caches = r._forward_for(t)(r.param_leaves, r.kv_caches, r._device_inputs(first, t), r._no_prev)
        q_index = np.zeros(len(batch.logits_indices), np.int32)
        if not speculating:
            return self._zeros(hidden), q_index
        outs, alive = [self._draw(hidden, batch, speculating, seeds, 0)], [speculating]
        for i in range(1, int(drafts.max())):
            now = [s for s in alive[-1] if drafts[s] > i]
            prev = {s: j for j, s in enumerate(alive[-1])}
            step = self._decode_batch(batch, now, [placeholder(prev[s]) for s in now], starts, i)
            t = bucket_for(step.num_tokens, r.token_buckets)
            hidden, r.kv_caches = r._forward_for(t)(r.param_leaves, r.kv_caches, r._device_inputs(step, t),
                                                    outs[-1][0])
            outs.append(self._draw(hidden, batch, now, seeds, i))
            alive.append(now)
        tokens = jax.device_get([o[0] for o in outs])
        row_of = [{s: j for j, s in enumerate(a)} for a in alive]
        first_row = np.cumsum(np.concatenate([[0], drafts + 1]))[:-1]  # each sequence's first logits row
        for s in speculating:
            req = batch.requests[s]
            req.spec_token_ids = [int(tokens[i][row_of[i][s]]) for i in range(int(drafts[s]))]
            batch.token_ids[cu[s] + 1: cu[s + 1]] = req.spec_token_ids
            q_index[first_row[s]: first_row[s] + drafts[s]] = [i * r.max_sampled + row_of[i][s]
                                                               for i in range(int(drafts[s]))]
        q = [o[1] for o in outs] + [self._zeros_rows(hidden)] * (self.k - len(outs))
        return jnp.concatenate(q, axis=0), q_index

    def after_verify(self, request_id: str, start: int, num_drafts: int, num_accepted: int) -> None:
        """All of a sequence's drafts accepted: the last one (at start + num_drafts) was never fed to the draft."""
        if num_drafts and num_accepted == num_drafts:
            self._lag[request_id] = start + num_drafts

    # ---- pieces ------------------------------------------------------------------------------------

    def _batch(self, batch: RaggedBatch, items: list[tuple[int, int, list[int]]], speculating: list[int]
               ) -> RaggedBatch:
        """The draft's first forward: each item's tokens from its first position, the target's block tables."""
        ps = self.runner.page_size
        lens = np.array([len(toks) for _, _, toks in items], np.int32)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        seqs = np.array([s for s, _, _ in items], np.int32)
        positions = np.concatenate([p0 + np.arange(len(toks)) for _, p0, toks in items]).astype(np.int32)
        table = batch.page_table[seqs]
        owner = np.repeat(np.arange(len(items)), lens)
        slots = table[owner, positions // ps] * ps + positions % ps
        where = {s: j for j, s in enumerate(seqs.tolist())}
        return RaggedBatch(requests=[batch.requests[s] for s in seqs], num_decodes=int(np.sum(lens == 1)),
                           token_ids=np.array([t for _, _, toks in items for t in toks], np.int32),
                           positions=positions, cu_q_lens=cu,
                           kv_lens=np.array([p0 + len(toks) for _, p0, toks in items], np.int32), page_table=table,
                           slot_mapping=slots.astype(np.int32),
                           logits_indices=np.array([cu[where[s] + 1] - 1 for s in speculating], np.int32),
                           samples=np.ones(len(items), bool))

    def _decode_batch(self, batch: RaggedBatch, seqs: list[int], tokens: list[int], starts: np.ndarray,
                      i: int) -> RaggedBatch:
        """Draft step i: each sequence feeds its draw i - 1 (a placeholder) at position start + i."""
        ps, n = self.runner.page_size, len(seqs)
        idx = np.array(seqs, np.int32)
        positions = (starts[idx] + i).astype(np.int32)
        table = batch.page_table[idx]
        slots = table[np.arange(n), positions // ps] * ps + positions % ps
        return RaggedBatch(requests=[batch.requests[s] for s in seqs], num_decodes=n,
                           token_ids=np.array(tokens, np.int32), positions=positions,
                           cu_q_lens=np.arange(n + 1, dtype=np.int32), kv_lens=positions + 1, page_table=table,
                           slot_mapping=slots.astype(np.int32), logits_indices=np.arange(n, dtype=np.int32),
                           samples=np.ones(n, bool))

    def _draw(self, hidden, batch: RaggedBatch, seqs: list[int], seeds: list[int], i: int) -> tuple[Any, Any]:
        """Draft i of each of `seqs` (token index len(output) + i), with its distribution."""
        r = self.runner
        rows = [(batch.requests[s].sampling_params, seeds[s], len(batch.requests[s].output_token_ids) + i)
                for s in seqs]
        a = SamplingArrays.build(rows, r.sampling_bucket(len(rows)))
        args = r._put((a.temperature, a.top_k, a.top_p, a.min_p, a.seed, a.step))
        return self._sample(r.param_leaves, hidden, *args)

    def _zeros_rows(self, hidden) -> jax.Array:
        if self._no_q is None:
            self._no_q = jnp.zeros((self.runner.max_sampled, self.spec.vocab_size), jnp.float32,
                                   device=hidden.sharding)
        return self._no_q

    def _zeros(self, hidden) -> jax.Array:
        if self._no_q_all is None:
            self._no_q_all = jnp.concatenate([self._zeros_rows(hidden)] * self.k, axis=0)
        return self._no_q_all

    # ---- start-up ----------------------------------------------------------------------------------

    def warmup(self) -> None:
        """Compile the draft's forward buckets and its sampler for every sequence bucket."""
        r = self.runner
        r.warmup()
        t = r.token_buckets[0]
        hidden, r.kv_caches = r._forward_for(t)(r.param_leaves, r.kv_caches, r._device_inputs(empty_batch(), t),
                                                r._no_prev)
        for size in r.seq_buckets:
            a = SamplingArrays.build([], size)
            jax.block_until_ready(self._sample(r.param_leaves, hidden, *r._put(
                (a.temperature, a.top_k, a.top_p, a.min_p, a.seed, a.step))))

    def compile_count(self) -> int:
        return self.runner.compile_count() + self._sample._cache_size()


def _token_at(req, i: int) -> int:
    """Token i of the request's prompt + output."""
    p = len(req.prompt_token_ids)
    return req.prompt_token_ids[i] if i < p else req.output_token_ids[i - p]
