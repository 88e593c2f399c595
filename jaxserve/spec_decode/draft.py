"""The draft model: a smaller checkpoint of the target's vocabulary that proposes k tokens per sequence.

It runs in the engine's process on the target's mesh with its own parameters and its own KV pool, a mirror of the
target's: as many pages, indexed by the same block tables, so the target's page allocation, prefix cache and
rollback serve both (a page cached in the target's tree holds the draft's KV of the same tokens). Its work in a
step:

1. the draft's forward over the target's batch as scheduled, without its draft rows (decodes, prefill chunks: the
   draft's KV keeps pace with the target's), plus, for a sequence whose previous k drafts were all accepted, the
   last of them (the draft never fed it);
2. all k draws (`propose_draws`): draft 1 of each speculating sequence from the forward's last rows, then a loop
   of static trip count k - 1 (as `runner/decode_run.py` runs --num-scheduler-steps) whose iteration i feeds every
   sequence's draw i - 1 at its position start + i and draws draft i + 1; a sequence given fewer drafts writes its
   later iterations' KV to the trash page. It returns the k draws, their distributions and the KV pool.

In a round of decodes both run inside the round's one jitted call (`round.py`, inputs from `round_inputs`) and the
target reads the draws on the device; in a step with prefill chunks they are two calls (`propose`), then one copy
of the k draws to the host, which writes them into the target batch's draft rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.core.batch import RaggedBatch, empty_batch, placeholder
from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.platform.policy import choose_policy
from jaxserve.runner.buckets import bucket_for
from jaxserve.runner.compiles import compiled_variants
from jaxserve.runner.model_builder import init_sharded_kv_cache, load_model
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.parallel import effective_spec, replicate_kv_heads, shard_model
from jaxserve.runner.sampler import SamplingArrays
from jaxserve.runner.sampling import DRAWS
from jaxserve.spec_decode.rejection import sample_draft
from modelspec.spec import ModelSpec, load_model_spec


def propose_draws(runner: ModelRunner, k: int, t: int, draw: str, param_leaves, kv_caches, hidden_rows, starts, slots,
                  page_table, limits, temperature, top_k, top_p, min_p, seed, step):
    """The k draws of S speculating sequences (S = the sampling bucket; rows past the real ones have limit 0):
    draft 1 from `hidden_rows`, then k - 1 decode iterations over `t` padded tokens. Sequence j's draft i is drawn
    at token index step[j] + i; iteration i writes its KV at slots[i, j] (position starts[j] + i) while i <
    limits[j]. Returns (tokens [k, max_sampled], q [k * max_sampled, V], kv_caches)."""
    model = runner.model(param_leaves)
    rows, n_seq, n = temperature.shape[0], runner.max_num_seqs, runner.max_sampled
    num_seqs = jnp.sum(limits > 0).astype(jnp.int32)
    real = jnp.arange(rows) < num_seqs
    cu = jnp.minimum(jnp.arange(n_seq + 1, dtype=jnp.int32), num_seqs)
    table = jnp.zeros((n_seq, page_table.shape[1]), jnp.int32).at[:rows].set(page_table)

    def draw_at(hidden, i):  # (not `draw`: that would hide the variant's name from sample_draft)
        logits = model.compute_logits(hidden[:rows], runner.ops.matmul)
        return sample_draft(logits, temperature, top_k, top_p, min_p, seed, step + i, draw=draw,
                            cut=runner.policy.sampler_cut)

    tok, q = draw_at(hidden_rows, 0)
    tokens = jnp.zeros((k, n), jnp.int32).at[0, :rows].set(tok)
    qs = jnp.zeros((k, n, q.shape[-1]), jnp.float32).at[0, :rows].set(q.astype(jnp.float32))

    def body(i, carry):
        kv, tok, tokens, qs = carry
        live = real & (i < limits)
        pos = starts + jnp.minimum(i, jnp.maximum(limits - 1, 0))  # a finished sequence stays in its pages
        meta = AttentionMetadata(
            slot_mapping=jnp.pad(jnp.where(live, slots[i], 0), (0, t - rows)), cu_q_lens=cu,
            kv_lens=jnp.zeros(n_seq, jnp.int32).at[:rows].set(jnp.where(real, pos + 1, 0)),
            page_table=table, num_seqs=num_seqs, num_decodes=num_seqs)
        hidden, kv = model(jnp.pad(tok, (0, t - rows)), jnp.pad(pos, (0, t - rows)), kv, meta,
                           runner.policy.ops_for(True))  # decodes only
        new, q = draw_at(hidden, i)
        return kv, new, tokens.at[i, :rows].set(new), qs.at[i, :rows].set(q.astype(jnp.float32))

    kv_caches, _, tokens, qs = jax.lax.fori_loop(1, k, body, (kv_caches, tok, tokens, qs))
    return tokens, qs.reshape(k * n, -1), kv_caches


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
        policy = choose_policy(weights, kv, attention_backend=target.ops.attention.name, cpu_kernels=config.cpu_kernels,
                               token_buckets=target.token_buckets, seq_buckets=target.seq_buckets,
                               overlapped=bool(config.async_scheduling))
        self.runner = ModelRunner(weights, kv, policy, page_size=config.page_size, max_model_len=max_model_len,
                                  max_num_seqs=config.max_num_seqs, token_buckets=target.token_buckets,
                                  seq_buckets=target.seq_buckets)
        self._fns: dict[tuple[int, str], Any] = {}  # (sampling bucket, draw) -> the jitted k draws
        self._no_q: jax.Array | None = None
        self._no_q_all: jax.Array | None = None
        self._lag: dict[str, int] = {}  # request id -> the position of an accepted draft the draft never fed

    # ---- one step ----------------------------------------------------------------------------------

    def propose(self, batch: RaggedBatch, seeds: list[int], live: set[str]) -> tuple[Any, np.ndarray]:
        """Run the draft for `batch` and write its proposals into the draft rows (and `spec_token_ids`) of the
        speculating sequences; returns (q_flat [k * max_sampled, V] on the device, the q row of each logits row)."""
        r = self.runner
        first, speculating, starts = self.plan(batch, live, r.token_buckets[-1])
        hidden = r.forward(first)
        if not speculating:
            return self._zeros(hidden), np.zeros(len(batch.logits_indices), np.int32)
        tokens, q_flat = self._draws(hidden, batch, speculating, seeds, starts)
        cu = batch.cu_q_lens
        for j, s in enumerate(speculating):
            req, n = batch.requests[s], int(batch.num_drafts[s])
            req.spec_token_ids = tokens[:n, j].tolist()
            batch.token_ids[cu[s] + 1: cu[s + 1]] = req.spec_token_ids
        return q_flat, self.q_index(batch, speculating)

    def plan(self, batch: RaggedBatch, live: set[str], max_tokens: int) -> tuple[RaggedBatch, list[int], np.ndarray]:
        """The draft's first forward for `batch` (its tokens without the draft rows, after a lagging accepted draft
        where `max_tokens` leaves room), the speculating sequences and each sequence's first position."""
        items, speculating, starts = self._items(batch, live, max_tokens)
        return self._batch(batch, items, speculating), speculating, starts

    def _items(self, batch: RaggedBatch, live: set[str], max_tokens: int) -> tuple[list, list[int], np.ndarray]:
        self._lag = {rid: p for rid, p in self._lag.items() if rid in live}
        cu, drafts = batch.cu_q_lens, batch.num_drafts
        q_lens = np.diff(cu)
        starts = batch.kv_lens - q_lens
        items = []  # (sequence, first position, tokens)
        room = max_tokens - int(np.sum(q_lens - drafts))  # lagging tokens the forward's bucket still holds
        for s, req in enumerate(batch.requests):
            real = int(q_lens[s] - drafts[s])
            lag = self._lag.pop(req.request_id, -2) == starts[s] - 1
            toks = batch.token_ids[cu[s]: cu[s] + real].tolist()
            if lag and room > 0:  # without room the draft's KV misses that token: its proposals, never outputs, suffer
                toks, room = [_token_at(req, int(starts[s]) - 1)] + toks, room - 1
            items.append((s, int(starts[s]) + real - len(toks), toks))
        items.sort(key=lambda it: len(it[2]) != 1)  # the draft's decodes first, as the batch format wants
        return items, [s for s, _, _ in items if drafts[s] > 0], starts

    def round_inputs(self, batch: RaggedBatch, seeds: list[int], steps: list[int], size: int, live: set[str],
                     chained: bool) -> tuple[tuple, np.ndarray]:
        """The draft's side of a round of `batch` in one dispatch (`round.py`), for `size` sequences: (its first
        forward packed, that forward's row -> sequence, each draw row's sequence, first positions, block tables,
        limits, sampling rows; the rows of the token before the last), and the q row of each logits row. Writes
        the draft rows' placeholders into `batch.token_ids`. `chained`: each sequence's first forward is the
        carry's two newest tokens (the first written only when it is a draft the draft never fed, as a round
        that follows a collected one would)."""
        r = self.runner
        n_seq, m = r.max_num_seqs, r.max_sampled
        cu, drafts = batch.cu_q_lens, batch.num_drafts
        starts = (batch.kv_lens - np.diff(cu)).astype(np.int32)
        if chained:  # the token before the last, then the last (placeholders of the carry), at their positions
            items = [(s, int(starts[s]) - 1, [placeholder(n_seq + s), placeholder(s)]) for s in range(batch.num_seqs)]
            speculating = [s for s in range(batch.num_seqs) if drafts[s] > 0]
        else:
            items, speculating, starts = self._items(batch, live, 2 * size)
        td = r.policy.token_buckets((2 * size,))[0]
        first_batch = self._batch(batch, items, speculating) if items else empty_batch()
        row_seq, before = np.full(td, -1, np.int32), np.zeros(td, bool)
        row_seq[: first_batch.num_tokens] = np.repeat([s for s, _, _ in items], [len(t) for _, _, t in items])
        if chained:
            before[: first_batch.num_tokens: 2] = True
        n, idx = len(speculating), np.array(speculating, np.int32)
        d_seq, lim, first = np.full(size, -1, np.int32), np.zeros(size, np.int32), np.zeros(size, np.int32)
        d_seq[:n], lim[:n], first[:n] = idx, drafts[idx], starts[idx]
        table = np.zeros((size, r.pages_per_seq), np.int32)
        table[:n, : batch.page_table.shape[1]] = batch.page_table[idx]
        a = SamplingArrays.build([(batch.requests[s].sampling_params, seeds[s], steps[s]) for s in speculating], size)
        batch.token_ids = batch.token_ids.copy()
        for j, s in enumerate(speculating):  # draft i + 1 of j: what the draws leave at n_seq + i * m + j
            c, d = int(cu[s]), int(drafts[s])
            batch.token_ids[c + 1: c + 1 + d] = [placeholder(n_seq + i * m + j) for i in range(d)]
        return ((r.layout.pack(first_batch, td), row_seq, before, d_seq, first, table, lim, *a.rows()),
                self.q_index(batch, speculating))

    def q_index(self, batch: RaggedBatch, speculating: list[int]) -> np.ndarray:
        """The row of q_flat (`propose_draws`'s q, flattened) each logits row of `batch` verifies against."""
        q_index = np.zeros(len(batch.logits_indices), np.int32)
        first_row = np.cumsum(np.concatenate([[0], batch.num_drafts + 1]))[:-1]  # each sequence's first logits row
        for j, s in enumerate(speculating):
            n = int(batch.num_drafts[s])
            q_index[first_row[s]: first_row[s] + n] = np.arange(n) * self.runner.max_sampled + j
        return q_index

    def draw_inputs(self, batch: RaggedBatch, seqs: list[int], seeds: list[int], starts: np.ndarray, rows: int
                    ) -> tuple[str, tuple]:
        """`propose_draws`'s host inputs for the sequences `seqs` of `batch`, padded to `rows`: (draw, arrays)."""
        r, k, ps = self.runner, self.k, self.runner.page_size
        a = SamplingArrays.build([(batch.requests[s].sampling_params, seeds[s],
                                   len(batch.requests[s].output_token_ids)) for s in seqs], rows)
        n = len(seqs)
        idx = np.array(seqs, np.int32)
        lim, first = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        lim[:n], first[:n] = batch.num_drafts[idx], starts[idx]
        table = np.zeros((rows, r.pages_per_seq), np.int32)
        table[:n, : batch.page_table.shape[1]] = batch.page_table[idx]
        ahead = first[None, :] + np.arange(k, dtype=np.int32)[:, None]  # [k, rows]: iteration i's position
        page = np.minimum(ahead // ps, r.pages_per_seq - 1)
        slots = table[np.arange(rows)[None, :], page] * ps + ahead % ps
        live = (np.arange(k)[:, None] >= 1) & (np.arange(k)[:, None] < lim[None, :])
        return a.draw, (first, np.where(live, slots, 0).astype(np.int32), table, lim, *a.rows())

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

    def _fn(self, rows: int, draw: str) -> Any:
        """The jitted k draws for a sampling bucket of `rows` (its loop's forward pads to that row count's bucket),
        drawing as `draw` says (`sampling.DRAWS`)."""
        if (rows, draw) not in self._fns:
            r = self.runner
            fn = functools.partial(propose_draws, r, self.k, bucket_for(rows, r.token_buckets), draw)
            self._fns[rows, draw] = r.jit_step(fn, num_inputs=11, num_outputs=2)
        return self._fns[rows, draw]

    def _draws(self, hidden, batch: RaggedBatch, seqs: list[int], seeds: list[int], starts: np.ndarray
               ) -> tuple[np.ndarray, Any]:
        """Every draft of `seqs` in one call: (tokens [k, max_sampled] on the host, q_flat on the device)."""
        r = self.runner
        rows = r.sampling_bucket(len(seqs))
        draw, args = self.draw_inputs(batch, seqs, seeds, starts, rows)
        tokens, q_flat, r.kv_caches = self._fn(rows, draw)(r.param_leaves, r.kv_caches, hidden, *r.put(args))
        return np.asarray(jax.device_get(tokens)), q_flat

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
        hidden = r.forward(empty_batch())
        for size in r.seq_buckets:
            for draw in DRAWS:
                self._warm(hidden, size, draw)

    def _warm(self, hidden, rows: int, draw: str) -> None:
        """Compile (and run once) the k draws of a sampling bucket on no sequence: every row's limit is 0."""
        r, z = self.runner, np.zeros(rows, np.int32)
        a = SamplingArrays.build([], rows)
        args = r.put((z, np.zeros((self.k, rows), np.int32), np.zeros((rows, r.pages_per_seq), np.int32), z,
                      *a.rows()))
        tokens, _, r.kv_caches = self._fn(rows, draw)(r.param_leaves, r.kv_caches, hidden, *args)
        jax.block_until_ready(tokens)

    def compile_count(self) -> int:
        return self.runner.compile_count() + compiled_variants(self._fns.values())


def _token_at(req, i: int) -> int:
    """Token i of the request's prompt + output."""
    p = len(req.prompt_token_ids)
    return req.prompt_token_ids[i] if i < p else req.output_token_ids[i - p]
