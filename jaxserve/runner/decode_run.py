"""Several decode steps in one dispatch: forward, logits and sampling k times in one jitted call.

When every sequence of a step is decoding, the engine may run k steps before the host looks again. Each
iteration feeds what the previous one drew, writes its KV into slots the scheduler reserved, draws with the same
(seed, token index) as a one-step dispatch would, and checks EOS, stop token ids and each sequence's token limit
on the device: a sequence that has stopped writes its KV only to the trash page from then on. On an accelerator
the trip count is static, so it never waits on the host between iterations; where the platform policy says so (a
CPU) the run ends once every sequence has stopped, so a request's last run costs the steps it needs, not k. The
host drops what a stopped sequence drew after its stop (and cuts at stop strings) when it collects.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.batch import RaggedBatch
from jaxserve.core.request import Request
from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.runner.buckets import bucket_for
from jaxserve.runner.compiles import compiled_variants
from jaxserve.runner.sampler import SamplingArrays
from jaxserve.runner.sampling import DRAWS, draw_tokens

MAX_DEVICE_STOP_IDS = 4  # stop token ids a request may have and still decode several steps a dispatch


@dataclass
class DecodeRun:
    """Host inputs of k decode steps of S sequences (S = the batch's sequences, all decoding)."""

    tokens: np.ndarray  # [S] int32, each sequence's last token (whose KV the first iteration writes)
    positions: np.ndarray  # [S] int32, that token's position
    slots: np.ndarray  # [k, S] int32, the KV slot of position + i (trash page 0 past the sequence's limit)
    page_table: np.ndarray  # [S, P] int32
    limits: np.ndarray  # [S] int32, tokens the sequence may draw (1..k)
    stop_ids: np.ndarray  # [S, MAX_DEVICE_STOP_IDS + 1] int32: EOS (unless ignore_eos) and stop ids, -1 padded

    @classmethod
    def build(cls, batch: RaggedBatch, limits: list[int], k: int, page_size: int) -> DecodeRun:
        """From a decode-only batch (one token per sequence) and each sequence's limit."""
        s = batch.num_seqs
        lim = np.asarray(limits, np.int32)
        pos = batch.positions.astype(np.int32)
        ahead = pos[None, :] + np.arange(k, dtype=np.int32)[:, None]  # [k, S]
        table = batch.page_table
        page = np.minimum(ahead // page_size, table.shape[1] - 1)
        slots = table[np.arange(s)[None, :], page] * page_size + ahead % page_size
        slots = np.where(np.arange(k)[:, None] < lim[None, :], slots, 0).astype(np.int32)
        stop_ids = np.full((s, MAX_DEVICE_STOP_IDS + 1), -1, np.int32)
        for i, req in enumerate(batch.requests):
            params = req.sampling_params
            ids = list(params.stop_token_ids)
            if not params.ignore_eos and req.eos_token_id is not None:
                ids.append(req.eos_token_id)
            stop_ids[i, : len(ids)] = ids
        return cls(batch.token_ids.astype(np.int32), pos, slots, table, lim, stop_ids)


def can_run_on_device(requests: list[Request]) -> bool:
    """Whether these requests can decode several steps a dispatch: few enough stop ids for the device's check,
    no logprobs asked for (a decode run computes none), and no logits processing (penalties,
    bias and bans need each step's tokens on the host)."""
    return all(len(r.sampling_params.stop_token_ids) <= MAX_DEVICE_STOP_IDS and r.sampling_params.logprobs is None
               and not r.sampling_params.needs_processing for r in requests)


def _decode_run_impl(runner: Any, k: int, t: int, draw: str, param_leaves, kv_caches, tokens, positions, slots,
                     page_table, limits, stop_ids, temperature, top_k, top_p, min_p, seed, step):
    """The jitted body: k iterations of forward + logits + draw (`draw`, as `sampling.draw_tokens`) over `t` padded
    tokens (the token bucket a one-step dispatch of these sequences would use); returns (drawn [k, S], kv_caches),
    S the sampling bucket. No logprobs: a run's requests asked for none (`can_run_on_device`), and the
    vocabulary's logsumexp each iteration was not free (docs/tuning.md)."""
    model = runner.model(param_leaves)
    s_rows = temperature.shape[0]
    n_seq = runner.max_num_seqs
    num_seqs = jnp.sum(limits > 0).astype(jnp.int32)
    real = jnp.arange(s_rows) < num_seqs
    pad_t = t - s_rows
    cu = jnp.minimum(jnp.arange(n_seq + 1, dtype=jnp.int32), num_seqs)
    table = jnp.zeros((n_seq, page_table.shape[1]), jnp.int32).at[:s_rows].set(page_table)

    def body(i, carry):
        kv, tok, done, drawn = carry
        live = real & ~done
        pos = positions + jnp.minimum(i, jnp.maximum(limits - 1, 0))  # a stopped sequence stays in its pages
        slot = jnp.where(live, slots[i], 0)
        meta = AttentionMetadata(
            slot_mapping=jnp.pad(slot, (0, pad_t)),
            cu_q_lens=cu,
            kv_lens=jnp.zeros(n_seq, jnp.int32).at[:s_rows].set(jnp.where(real, pos + 1, 0)),
            page_table=table, num_seqs=num_seqs, num_decodes=num_seqs)
        hidden, kv = model(jnp.pad(tok, (0, pad_t)), jnp.pad(pos, (0, pad_t)), kv, meta, runner.policy.ops_for(True))
        logits = model.compute_logits(hidden[:s_rows], runner.ops.matmul)
        new = draw_tokens(logits, temperature, top_k, top_p, min_p, seed, step + i, draw=draw,
                          cut=runner.policy.sampler_cut)
        new = jnp.where(live, new, tok)
        stopped = jnp.any(new[:, None] == stop_ids, axis=-1) | (i + 1 >= limits)
        return kv, new, done | (live & stopped), drawn.at[i].set(new)

    init = (kv_caches, tokens, ~real, jnp.zeros((k, s_rows), jnp.int32))
    if runner.policy.decode_run_exits_early:  # up to k iterations, none once every sequence has stopped
        _, out = jax.lax.while_loop(lambda c: (c[0] < k) & ~jnp.all(c[1][2]),
                                    lambda c: (c[0] + 1, body(c[0], c[1])), (jnp.int32(0), init))
    else:  # a static trip count: the loop never asks the device whether to go on
        out = jax.lax.fori_loop(0, k, body, init)
    kv_caches, _, _, drawn = out
    return drawn, kv_caches


class DecodeRunner:
    """Runs `DecodeRun`s of k steps on a `ModelRunner`'s parameters and KV pool, compiled per (token bucket,
    sampling bucket, draw variant)."""

    def __init__(self, runner: Any, k: int) -> None:
        self.runner, self.k = runner, k
        self._fns: dict[tuple[int, str], Any] = {}  # (token bucket, draw) -> jitted run

    def _fn(self, t: int, draw: str) -> Any:
        if (t, draw) not in self._fns:
            fn = functools.partial(_decode_run_impl, self.runner, self.k, t, draw)
            self._fns[t, draw] = self.runner.jit_step(fn, num_inputs=12, num_outputs=1)
        return self._fns[t, draw]

    def execute(self, batch: RaggedBatch, sampling: SamplingArrays, run: DecodeRun) -> np.ndarray:
        """Run k steps; returns what each sequence drew, [k, S] (rows past a sequence's stop are to be dropped)."""
        r = self.runner
        t = bucket_for(batch.num_seqs, r.token_buckets)
        inputs = r.put(pad_run(run, sampling, r.pages_per_seq))
        drawn, r.kv_caches = self._fn(t, sampling.draw)(r.param_leaves, r.kv_caches, *inputs)
        return np.asarray(jax.device_get(drawn))[:, : batch.num_seqs]

    def warmup(self) -> None:
        """Compile every sampling bucket and draw variant (with the token bucket a decode step of that many
        sequences uses)."""
        r = self.runner
        for rows in r.seq_buckets:
            if rows > r.max_num_seqs:
                continue
            sampling = SamplingArrays.build([], rows)
            empty = DecodeRun(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros((self.k, 0), np.int32),
                              np.zeros((0, 1), np.int32), np.zeros(0, np.int32),
                              np.zeros((0, MAX_DEVICE_STOP_IDS + 1), np.int32))
            t = bucket_for(rows, r.token_buckets)
            for draw in DRAWS:
                out = self._fn(t, draw)(r.param_leaves, r.kv_caches, *r.put(pad_run(empty, sampling, r.pages_per_seq)))
                r.kv_caches = out[1]
                jax.block_until_ready(out[0])

    def compile_count(self) -> int:
        """Compiled variants so far."""
        return compiled_variants(self._fns.values())


def pad_run(run: DecodeRun, sampling: SamplingArrays, pages_per_seq: int) -> tuple:
    """The jitted call's inputs: each per-sequence array padded to the sampling bucket (padded rows: limit 0)."""
    rows = sampling.temperature.shape[0]
    s = run.tokens.shape[0]

    def pad(x: np.ndarray, fill: int = 0) -> np.ndarray:
        out = np.full((rows, *x.shape[1:]), fill, x.dtype)
        out[:s] = x
        return out

    table = np.zeros((rows, pages_per_seq), np.int32)
    table[:s, : run.page_table.shape[1]] = run.page_table
    slots = np.zeros((run.slots.shape[0], rows), np.int32)
    slots[:, :s] = run.slots
    return (pad(run.tokens), pad(run.positions), slots, table, pad(run.limits), pad(run.stop_ids, -1),
            sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.seed, sampling.step)
