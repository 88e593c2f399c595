"""A whole speculative round in one dispatch, where the shapes allow it: every sequence of the batch decodes
(a verify chunk of its last token and its drafts, or a plain decode).

One jitted call runs, on the device: for a draft model, its forward over each sequence's newest token (after the
accepted draft it never fed, when there is one), its k draws (`draft.propose_draws`), then the target's forward
over the verify chunks, whose draft rows are placeholders the draws fill on the device; for n-gram lookup, whose
proposals the host knows, the target's forward over the chunks as scheduled. Then the logits of every row and the
rejection sampler (`rejection.verify`): each row's draft is the chunk's next token, read on the device. The host
reads one small result a round: each row's acceptance, emitted token and logprob.

A round may be chained to the one before it, still in flight (`chain.py`): the host laid it out as if that round
accepted none of its drafts; the device moves each linked sequence's positions, KV slots, KV length and token
indices on by the drafts that round accepted, and reads its newest tokens from the round's carry (how many
drafts each sequence verified and accepted, its last token and the one before).

Shapes are fixed per sequence bucket S: the target's forward runs S x (k + 1) rows (not padded to a forward's
token bucket: on a CPU 8 rows for 5 cost measurably more), the draft's 2 S, its draws S; so a round compiles once
per (S, sampler tier) at warm-up (the platform's smallest step still applies). KV
rollback stays with the host's bookkeeping: a rejected row's KV is written, then left past the computed length.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.batch import RaggedBatch, empty_batch, is_placeholder, placeholder_seq
from jaxserve.runner.buckets import bucket_for, speculative_round_sizes
from jaxserve.runner.compiles import compiled_variants
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.parallel import params_shardings
from jaxserve.runner.sampler import TIERS, SamplingArrays, tier_for
from jaxserve.runner.sampling import logprobs_of
from jaxserve.spec_decode.draft import propose_draws
from jaxserve.spec_decode.ngram import DEVICE_WINDOW, lookup_on_device
from jaxserve.spec_decode.rejection import verify


@dataclasses.dataclass
class RoundInputs:
    """One round's host arrays (R = S (k + 1) logits rows, T the target's token bucket, M = max_sampled)."""

    packed: np.ndarray  # the target's step (`StepLayout.pack`); placeholder(s < N): sequence s's last token in
    # the carry, placeholder(N + i M + j): draft i + 1 of speculating sequence j (N = max_num_seqs)
    has_draft: np.ndarray  # [R] bool: the row verifies a draft (the chunk's next token)
    q_index: np.ndarray  # [R] int32: its q row (a draft model)
    row_seq: np.ndarray  # [T] int32: each token row's sequence, -1 for padding
    logit_seq: np.ndarray  # [R] int32: each logits row's sequence, -1 for padding
    first_row: np.ndarray  # [M] int32: each sequence's first logits row
    link: np.ndarray  # [max_num_seqs] int32: the sequence of the round in flight it continues, -1: none
    sampling: SamplingArrays  # [R] rows
    draft: tuple = ()  # the draft's side (`DraftProposer.round_inputs`)

    def arrays(self) -> tuple:
        return (self.packed, self.has_draft, self.q_index, self.row_seq, self.logit_seq, self.first_row, self.link,
                *self.sampling.rows())


def _shift(runner: ModelRunner, tok, pos, meta, row_seq, shift, pool):
    """Token rows moved `shift[s]` positions on for their sequence s (KV slots and lengths with them); each
    placeholder token read from `pool`."""
    ps = runner.page_size
    seq = jnp.maximum(row_seq, 0)
    pos = pos + jnp.where(row_seq >= 0, shift[seq], 0)
    page = meta.page_table[seq, jnp.minimum(pos // ps, meta.page_table.shape[1] - 1)]
    slots = jnp.where(row_seq >= 0, page * ps + pos % ps, meta.slot_mapping)
    tok = jnp.where(is_placeholder(tok), pool[jnp.clip(placeholder_seq(tok), 0, pool.shape[0] - 1)], tok)
    return tok, pos, dataclasses.replace(meta, slot_mapping=slots, kv_lens=meta.kv_lens + shift)


def _round_impl(target: ModelRunner, draft: ModelRunner | None, k: int, tier: str, param_t, kv_t, param_d, kv_d,
                verify_in, carry, draft_in, lookup: tuple[int, int] | None = None):
    """One round: (accepted [R], tokens [R], logprobs [R][, top ids, top logprobs]), its carry (accepted drafts,
    last token, the token before, drafts verified, per sequence [M]; the drafts themselves [M, k]), kv_t, kv_d.
    `lookup`: n-gram's (min_n, max_n), whose chained rounds propose on the device (`draft_in`: window, room)."""
    packed, has_draft, q_index, row_seq, logit_seq, first_row, link, temperature, top_k, top_p, min_p, seed, \
        step = verify_in
    acc_in, last_in, before_in, drafts_in, proposed_in = carry
    draw, want_top, _ = TIERS[tier]
    shift = jnp.where(link >= 0, acc_in[jnp.maximum(link, 0)], 0)  # [max_num_seqs]
    lagging = (link >= 0) & (drafts_in[jnp.maximum(link, 0)] > 0) & (shift == drafts_in[jnp.maximum(link, 0)])
    last, before = last_in[jnp.maximum(link, 0)], before_in[jnp.maximum(link, 0)]
    pool = last  # placeholder(s): sequence s's last token; past max_num_seqs, the draws
    q = None
    if draft is not None:
        d_packed, d_row_seq, d_before, d_seq, first, table, limits, *rows = draft_in
        d_tok, d_pos, d_meta, d_idx = draft.layout.unpack(d_packed)
        d_tok, d_pos, d_meta = _shift(draft, d_tok, d_pos, d_meta, d_row_seq, shift,
                                      jnp.concatenate([last, before]))
        # The token before the last is fed only when it is the last draft, all accepted (else the draft's KV there
        # is already its own): its row writes the trash page, so the pool holds what a collected round leaves.
        fed = ~d_before | lagging[jnp.maximum(d_row_seq, 0)]
        d_meta = dataclasses.replace(d_meta, slot_mapping=jnp.where(fed, d_meta.slot_mapping,
                                                                    d_meta.slot_mapping % draft.page_size))
        hidden, kv_d = draft.model(param_d)(d_tok, d_pos, kv_d, d_meta, draft.policy.ops_for(False))
        d_shift = jnp.where(d_seq >= 0, shift[jnp.maximum(d_seq, 0)], 0)
        first = first + d_shift
        ps, n = draft.page_size, first.shape[0]
        ahead = first[None, :] + jnp.arange(k, dtype=jnp.int32)[:, None]  # [k, S]: iteration i's position
        slots = table[jnp.arange(n)[None, :], jnp.minimum(ahead // ps, table.shape[1] - 1)] * ps + ahead % ps
        live = (jnp.arange(k)[:, None] >= 1) & (jnp.arange(k)[:, None] < limits[None, :])
        rows[-1] = rows[-1] + d_shift  # the token index each draft is drawn at
        t_loop = bucket_for(n, draft.token_buckets)
        drafts, q_flat, kv_d = propose_draws(draft, k, t_loop, draw, param_d, kv_d, hidden[d_idx], first,
                                             jnp.where(live, slots, 0), table, limits, *rows)
        pool = jnp.concatenate([last, drafts.reshape(-1)])  # draft i + 1 of speculating j: N + i * M + j
        q = q_flat[q_index]
    real = None  # [k * M]: whether the device's proposal i of sequence j (at i * M + j) is one
    if lookup is not None:  # n-gram: a chained round's rows hold placeholders for proposals made here
        window, room = draft_in
        m, n_seq = window.shape[0], link.shape[0]
        seq = jnp.minimum(jnp.arange(m), n_seq - 1)
        props, ok = jax.vmap(lookup_on_device, in_axes=(0, 0, 0, 0, 0, None, None, None))(
            window, proposed_in[jnp.maximum(link, 0)][seq], shift[seq], last[seq], room, k, *lookup)
        pool = jnp.concatenate([last, props.T.reshape(-1)])
        real = ok.T.reshape(-1)
    tok_in, pos, meta, idx = target.layout.unpack(packed)
    tok, pos, meta = _shift(target, tok_in, pos, meta, row_seq, shift, pool)
    model = target.model(param_t)
    hidden, kv_t = model(tok, pos, kv_t, meta, target.policy.ops_for(False))
    r = temperature.shape[0]
    logits = model.compute_logits(hidden[idx][:r], target.ops.matmul)
    nxt = jnp.minimum(idx[:r] + 1, tok.shape[0] - 1)
    if real is not None:  # a row whose proposal the lookup did not find verifies none
        ph = placeholder_seq(tok_in[nxt]) - link.shape[0]
        has_draft = has_draft & (~is_placeholder(tok_in[nxt]) | (ph < 0) | real[jnp.clip(ph, 0, real.shape[0] - 1)])
    d = jnp.where(has_draft, tok[nxt], -1)  # a row's draft: the next token
    step = step + jnp.where(logit_seq >= 0, shift[jnp.maximum(logit_seq, 0)], 0)
    accepted, tokens = verify(logits, temperature, top_k, top_p, min_p, seed, step, d, q, draw=draw,
                              cut=target.policy.sampler_cut)
    # The carry: each sequence's accepted drafts (the rows before its first rejection), its last token and the one
    # before it (the last accepted draft, or the chunk's first token when none was).
    m = first_row.shape[0]
    good = (accepted & has_draft) | (logit_seq < 0)
    rejected = jnp.cumsum(~good)
    before_seq = rejected[first_row] - (~good[first_row]).astype(rejected.dtype)
    prefix = good & (rejected == before_seq[jnp.maximum(logit_seq, 0)]) & (logit_seq >= 0)
    acc = jax.ops.segment_sum(prefix.astype(jnp.int32), jnp.where(logit_seq >= 0, logit_seq, m), m + 1)[:m]
    at = jnp.minimum(first_row + acc, r - 1)
    chunk_first = tok[idx[first_row]]
    num_drafts = jax.ops.segment_sum(has_draft.astype(jnp.int32), jnp.where(logit_seq >= 0, logit_seq, m), m + 1)
    row_seq_l = jnp.maximum(logit_seq, 0)
    proposed = jnp.full((m + 1, k), -1, jnp.int32).at[jnp.where(has_draft, logit_seq, m), jnp.clip(
        jnp.arange(r) - first_row[row_seq_l], 0, k - 1)].set(d)[:m]  # the next round's lookup reads them
    carry_out = (acc, tokens[at], jnp.where(acc > 0, tokens[jnp.maximum(at - 1, 0)], chunk_first), num_drafts[:m],
                 proposed)
    return (accepted, tokens, *logprobs_of(logits, tokens, want_top)), carry_out, kv_t, kv_d


class FusedRound:
    """Runs decode-only speculative rounds in one dispatch each (see the module doc), compiled per (sequence
    bucket, sampler tier) at warm-up. `dispatch` leaves a round in flight; `collect` reads its small result."""

    def __init__(self, target: ModelRunner, k: int, draft: Any, ngram: Any = None) -> None:
        self.target, self.k, self.draft = target, k, draft  # draft: a DraftProposer or None
        self.lookup = (ngram.min_n, ngram.max_n) if ngram is not None else None  # an NgramProposer's n-grams
        self.sizes = speculative_round_sizes(target.seq_buckets, k,
                                             min(target.max_logits_rows, target.token_buckets[-1]))
        self._fns: dict[tuple[int, str], Any] = {}
        m = target.max_sampled
        self.no_carry = (*(jnp.zeros(m, jnp.int32, device=target.replicated) for _ in range(4)),
                         jnp.full((m, k), -1, jnp.int32, device=target.replicated))

    def accepts(self, batch: RaggedBatch) -> bool:
        """Whether `batch` runs as one round: every sequence draws, each on a chunk of its last token and drafts."""
        if not self.sizes or batch.num_seqs > self.sizes[-1] or not np.all(batch.samples):
            return False
        return bool(np.all(np.diff(batch.cu_q_lens) == 1 + batch.num_drafts))

    def size(self, num_seqs: int) -> int:
        """The sequence bucket a round of `num_seqs` sequences runs in."""
        return bucket_for(num_seqs, self.sizes)

    def _fn(self, size: int, tier: str) -> Any:
        if (size, tier) not in self._fns:
            t, d = self.target, self.draft
            fn = functools.partial(_round_impl, t, None if d is None else d.runner, self.k, tier, lookup=self.lookup)
            if t.mesh is None:
                self._fns[size, tier] = jax.jit(fn, donate_argnums=(1, 3))
            else:
                rep = t.replicated
                kv_t = jax.tree.map(lambda x: x.sharding, t.kv_caches)
                kv_d = jax.tree.map(lambda x: x.sharding, d.runner.kv_caches) if d is not None else rep
                p_d = jax.tree.leaves(params_shardings(d.runner.params)) if d is not None else rep
                self._fns[size, tier] = jax.jit(
                    fn, donate_argnums=(1, 3),
                    in_shardings=(jax.tree.leaves(params_shardings(t.params)), kv_t, p_d, kv_d, rep, rep, rep),
                    out_shardings=(rep, rep, kv_t, kv_d))
        return self._fns[size, tier]

    def prepare(self, batch: RaggedBatch, seeds: list[int], steps: list[int], live: set[str],
                link: list[int] | None = None, size: int | None = None, lookup: tuple | None = None) -> RoundInputs:
        """A round of `batch` (`accepts` it): sequence s's rows draw token indices steps[s] + j; `link`: the
        sequence of the round in flight each continues (None: none; `chain.py` lays such a batch out); `size`:
        the sequence bucket (default: the batch's); `lookup`: n-gram's (window [M, DEVICE_WINDOW], room [M]) for
        a chained round whose draft rows the device's lookup fills (`chain.py`; default: none)."""
        t, k = self.target, self.k
        size = size or self.size(batch.num_seqs)
        r = size * (k + 1)
        drafts = batch.num_drafts if batch.num_drafts is not None else np.zeros(batch.num_seqs, np.int32)
        q_index, draft = np.zeros(r, np.int32), ()
        if self.draft is not None:  # first: it writes the draft rows' placeholders into the batch
            draft, qi = self.draft.round_inputs(batch, seeds, steps, size, live, chained=link is not None)
            q_index[: len(qi)] = qi
        elif self.lookup is not None:
            m = t.max_sampled
            draft = lookup or (np.full((m, DEVICE_WINDOW), -1, np.int32), np.zeros(m, np.int32))
        rows, has, logit_seq = [], [], []
        for s, req in enumerate(batch.requests):
            n = int(drafts[s])
            rows += [(req.sampling_params, seeds[s], steps[s] + j) for j in range(n + 1)]
            has += [True] * n + [False]
            logit_seq += [s] * (n + 1)
        has_draft, ls = np.zeros(r, bool), np.full(r, -1, np.int32)
        has_draft[: len(has)], ls[: len(logit_seq)] = has, logit_seq
        tb = t.policy.token_buckets((r,))[0]  # compiled per S anyway: no padding to a forward's bucket
        row_seq = np.full(tb, -1, np.int32)
        row_seq[: batch.num_tokens] = np.repeat(np.arange(batch.num_seqs, dtype=np.int32), np.diff(batch.cu_q_lens))
        first_row = np.zeros(t.max_sampled, np.int32)
        first_row[: batch.num_seqs] = np.cumsum(np.concatenate([[0], drafts + 1]))[:-1]
        links = np.full(t.max_num_seqs, -1, np.int32)
        if link is not None:
            links[: len(link)] = link
        return RoundInputs(t.layout.pack(batch, tb), has_draft, q_index, row_seq, ls, first_row, links,
                           SamplingArrays.build(rows, r), draft)

    def dispatch(self, inputs: RoundInputs, carry: tuple | None = None) -> tuple:
        """Enqueue a round; returns its device futures (results, carry) and keeps the pools it returns."""
        t, d = self.target, self.draft
        size = inputs.sampling.temperature.shape[0] // (self.k + 1)
        p_d, kv_d = (d.runner.param_leaves, d.runner.kv_caches) if d is not None else ((), ())
        out, carry_out, t.kv_caches, kv_d = self._fn(size, tier_for(inputs.sampling))(
            t.param_leaves, t.kv_caches, p_d, kv_d, t.put(inputs.arrays()),
            self.no_carry if carry is None else carry, t.put(inputs.draft))
        if d is not None:
            d.runner.kv_caches = kv_d
        return out, carry_out

    def lower(self, inputs: RoundInputs) -> Any:
        """The round `dispatch` would run for `inputs`, lowered (to read its program; nothing runs)."""
        t, d = self.target, self.draft
        size = inputs.sampling.temperature.shape[0] // (self.k + 1)
        p_d, kv_d = (d.runner.param_leaves, d.runner.kv_caches) if d is not None else ((), ())
        return self._fn(size, tier_for(inputs.sampling)).lower(t.param_leaves, t.kv_caches, p_d, kv_d,
                                                              t.put(inputs.arrays()), self.no_carry,
                                                              t.put(inputs.draft))

    @staticmethod
    def collect(pending: tuple, num_rows: int, want_logprobs: bool) -> tuple:
        """Wait for a round and copy its first `num_rows` rows to the host: (accepted, tokens, logprobs, top ids,
        top logprobs, drafts each sequence verified), top ids and logprobs None without logprobs."""
        out, carry = pending
        rows, verified = jax.device_get((out if want_logprobs else out[:3], carry[3]))
        rows = tuple(np.asarray(x)[:num_rows] for x in rows)
        return (*rows, *((None, None) if not want_logprobs else ()), np.asarray(verified))

    def idle_inputs(self, size: int) -> RoundInputs:
        """A round of sequence bucket `size` on no sequence: it runs the whole program, every write going to the
        trash page (warm-up, reading or timing the program)."""
        return self.prepare(dataclasses.replace(empty_batch(), num_drafts=np.zeros(0, np.int32)), [], [], set(),
                            size=size)

    def warmup(self) -> None:
        """Compile (and run once, on no sequence) each size and tier."""
        for size in self.sizes:
            inputs = self.idle_inputs(size)
            for tier, (_, _, processed) in TIERS.items():
                if not processed:
                    inputs.sampling = _for_tier(size * (self.k + 1), tier)
                    jax.block_until_ready(self.dispatch(inputs)[0])

    def compile_count(self) -> int:
        return compiled_variants(self._fns.values())


def _for_tier(rows: int, tier: str) -> SamplingArrays:
    """Padding rows whose `tier_for` is `tier` (warm-up): a sampling row and a cut when the tier asks."""
    a = SamplingArrays.build([], rows)
    draw, want_top, _ = TIERS[tier]
    a.want_logprobs = want_top
    if draw != "greedy":
        a.temperature[0] = 1.0
    if draw == "cut":
        a.top_k[0] = 2
    return a
