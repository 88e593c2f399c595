"""Runs one ragged batch on the device: pad to a bucket, one jitted forward, one jitted sample.

The forward is compiled once per token bucket (the sequence axis of the metadata is always padded to
`max_num_seqs`, and attention loops only over the real sequences); logits and sampling are compiled once per
sequence bucket. The KV pool is donated to the forward, so XLA updates it in place. Warm-up compiles every
bucket at start-up; `compile_count()` lets tests assert that nothing compiles afterwards.

When the pool lives on a device mesh (always, when built by `model_builder`), both functions are jitted with
explicit shardings: parameters per the tensor-parallel table, KV pages on kv heads, everything else replicated.
`dispatch` and `collect` split a step so a caller can keep two engines (prefill and decode pools) in flight.
KV pages move between pools with `gather_pages` and `insert_pages` (donated), compiled per page-count bucket.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.core.batch import RaggedBatch, is_placeholder, placeholder_seq
from jaxserve.kernels.cpu import kernel_choice
from jaxserve.kernels.cpu.kernel_plan import KernelPlan
from jaxserve.model.attention.metadata import AttentionMetadata
from jaxserve.model.attention.select import kv_kind, select_backend
from jaxserve.runner.parallel import AXIS, fit_spec, params_shardings, put_global, replicated
from jaxserve.runner.prompt_logprobs import PromptHead, PromptRows
from jaxserve.runner.sampler import Sampler, SamplingArrays, sample_tokens

WARM_REAL_TOKENS = 512  # warm-up runs buckets up to this size once with real work
# Token buckets above this compile, on a CPU, with every dot a YNNPACK call of its own: from ~4096 rows XLA's CPU
# backend fuses each RMSNorm into the next projection's YNNPACK dot, which then runs well below its unfused speed.
# Below, the default fusions stay, since separate dots slow decode steps. See docs/tuning.md.
CPU_SEPARATE_DOTS_ABOVE = 2048
CPU_SEPARATE_DOTS_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
WARM_HISTORY = 544  # ...after this many tokens of (trash) history: past a 512-token decode block, 256-token KV blocks


def power_of_two_ladder(limit: int, start: int = 1) -> tuple[int, ...]:
    """start, 2*start, 4*start, ... up to and including `limit`."""
    ladder, b = [], start
    while b < limit:
        ladder.append(b)
        b *= 2
    ladder.append(limit)
    return tuple(ladder)


def half_octave_ladder(limit: int, start: int = 1) -> tuple[int, ...]:
    """Powers of two up to `start`, then 1.5x steps (..., 64, 96, 128, 192, ...) up to and including `limit`.

    Padding a step to its bucket wastes at most a third of its tokens above `start` (half with powers of two):
    a 320-token step runs at 384, not 512. Below `start` a step is too cheap for padding to matter, so the
    ladder stays coarse there and warm-up compiles few variants.
    """
    out, b = [], 1
    while b < limit:
        out += [b] if b < max(2, start) else [b, b * 3 // 2]
        b *= 2
    return tuple(sorted({x for x in out if x < limit} | {limit}))


def default_token_ladder(limit: int) -> tuple[int, ...]:
    """The engine's token buckets when none are configured: powers of two to 16, half-octave steps above
    (16, 24, 32, 48, 64, 96, ...), eighth-octave steps above 256 (..., 256, 288, 320, 352, 384, ..., 512, 576, ...).

    Above ~8 rows a CPU step's matmuls are no longer bound by reading the weights, so padded rows cost time;
    above 256 a prefill step is compute-bound and every padded token costs as much as a real one. Each bucket is
    one more compile at start-up. See docs/tuning.md."""
    out = {b for b in half_octave_ladder(limit, start=16) if b <= 256}
    b = 256
    while b < limit:
        out |= {b * k // 8 for k in range(8, 16) if b * k // 8 < limit}
        b *= 2
    return tuple(sorted(out | {limit}))


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
    prompt_logprobs: list[np.ndarray] | None = None  # PromptHead.compute's arrays when prompt rows were asked for


class ModelRunner:
    """Owns the parameters, the device KV pool and the compiled step functions."""

    def __init__(self, model: nnx.Module, kv_caches, *, page_size: int, max_model_len: int, max_num_seqs: int,
                 token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...],
                 cpu_kernels: bool = True, attention_backend: str = "auto",
                 kernel_plan: KernelPlan | None = None, max_logits_rows: int = 0) -> None:
        self.graphdef, self.params = nnx.split(model)
        # The jitted calls take the parameters as a flat list: the nnx State flattens in Python on every call (two
        # calls a step), a list of arrays in C++ (docs/tuning.md).
        self.param_leaves, self._param_tree = jax.tree.flatten(self.params)
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.max_num_seqs, self.max_logits_rows = max_num_seqs, max(max_logits_rows, max_num_seqs)  # + verify rows
        self.pages_per_seq = math.ceil(max_model_len / page_size)
        self.token_buckets = token_buckets
        self.seq_buckets = seq_buckets
        self.page_buckets = power_of_two_ladder(self.pages_per_seq)
        # The sampler pads its tokens to this length so the next forward, which may read them on the device
        # (asynchronous scheduling), has one input shape whatever the sequence bucket.
        self.max_sampled = max(seq_buckets)
        self.step_hook: Callable[[RaggedBatch, SamplingArrays], None] | None = None  # multi-host: announce steps
        sharding = kv_caches[0][0].sharding
        self.platform = next(iter(sharding.device_set)).platform  # "cpu", "gpu", "tpu"
        self.mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
        # XLA cannot split the CPU kernels' custom calls over a mesh of several devices.
        self.cpu_kernels = cpu_kernels and (self.mesh is None or self.mesh.size == 1)
        # The row counts whose matmuls use the kernel: where it was measured faster than XLA's (once per CPU, cached).
        if kernel_plan is None and self.cpu_kernels and self.platform == "cpu":
            kernel_plan = kernel_choice.choose(model, token_buckets, seq_buckets)
        self.kernel_plan = kernel_plan
        # Attention's implementation, chosen once: the step never looks at the platform (model/attention/select.py).
        k0 = kv_caches[0][0]
        self.attention = select_backend(attention_backend, self.platform, k0.dtype, k0.shape[3], page_size,
                                        cpu_kernels=self.cpu_kernels, num_devices=len(sharding.device_set),
                                        kv_cache_dtype=kv_kind(k0))
        wide = dict(compiler_options=CPU_SEPARATE_DOTS_OPTIONS) if self.platform == "cpu" else {}
        self.prompt_head = PromptHead(self, CPU_SEPARATE_DOTS_OPTIONS if wide else {})  # jitted on first use
        if self.mesh is None:  # plain single-device arrays
            self._replicated = None
            self._forward = jax.jit(self._forward_impl, donate_argnums=(1,))
            self._forward_wide = jax.jit(self._forward_impl, donate_argnums=(1,), **wide) if wide else self._forward
            self._sample = Sampler(self)  # plain, or processed when a row asks (penalties, bias, bans)
            self._insert = jax.jit(self._insert_impl, donate_argnums=(0,))
            self._gather = jax.jit(self._gather_impl, static_argnums=(2,))
            self._no_prev = jnp.zeros(self.max_sampled, jnp.int32, device=sharding)
            return
        rep = self._replicated = replicated(self.mesh)
        # A device array like the sampler's output: a numpy array here would be a second jit variant of the
        # forward, compiled on the first step that reads a previous step's tokens.
        self._no_prev = jnp.zeros(self.max_sampled, jnp.int32, device=rep)
        params_sh = jax.tree.leaves(params_shardings(self.params))
        kv_sh = jax.tree.map(lambda x: x.sharding, kv_caches)
        self._forward = jax.jit(self._forward_impl, donate_argnums=(1,),
                                in_shardings=(params_sh, kv_sh, rep, rep), out_shardings=(rep, kv_sh))
        self._forward_wide = jax.jit(self._forward_impl, donate_argnums=(1,), in_shardings=(params_sh, kv_sh, rep, rep),
                                     out_shardings=(rep, kv_sh), **wide) if wide else self._forward
        self._sample = Sampler(self, in_shardings=(params_sh, *(rep,) * 8), out_shardings=rep)
        # Transfers: the block's sharding follows from its head count (see `pages_sharding`); the pool keeps its own.
        self._gather = jax.jit(self._gather_impl, static_argnums=(2,))
        self._insert = jax.jit(self._insert_impl, donate_argnums=(0,), out_shardings=kv_sh)

    def pages_sharding(self, shape: tuple[int, ...]) -> jax.sharding.Sharding:
        """Sharding of a page block `[layers, 2, pages, page_size, heads, head_dim]` here: on heads if they divide."""
        if self.mesh is None:
            return self.kv_caches[0][0].sharding
        return NamedSharding(self.mesh, fit_spec(P(None, None, None, None, AXIS, None), shape, self.mesh))

    # Jitted bodies -------------------------------------------------------------------------------------------
    def _forward_impl(self, param_leaves, kv_caches, packed, prev_tokens, all_rows: bool = False):
        token_ids, positions, meta, logits_indices = self._unpack(packed)
        # A placeholder stands for what a sequence of the previous step drew, still on the device.
        drawn = prev_tokens[jnp.clip(placeholder_seq(token_ids), 0, prev_tokens.shape[0] - 1)]
        token_ids = jnp.where(is_placeholder(token_ids), drawn, token_ids)
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._param_tree, param_leaves))
        hidden, kv_caches = model(token_ids, positions, kv_caches, meta, cpu_kernel=self.cpu_kernels,
                                  attention=self.attention, plan=self.kernel_plan)
        return (hidden[logits_indices], hidden, kv_caches) if all_rows else (hidden[logits_indices], kv_caches)

    def _sample_impl(self, param_leaves, hidden_rows, temperature, top_k, top_p, min_p, seed, step, want_logprobs):
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._param_tree, param_leaves))
        logits = model.compute_logits(hidden_rows[: temperature.shape[0]], cpu_kernel=self.cpu_kernels,
                                      plan=self.kernel_plan)
        tokens, *rest = sample_tokens(logits, temperature, top_k, top_p, min_p, seed, step, want_logprobs)
        return (jnp.zeros(self.max_sampled, jnp.int32).at[: tokens.shape[0]].set(tokens), *rest)

    @staticmethod
    def _gather_impl(kv_caches, page_ids, stride: int):
        """Pages of every layer's K and V; every `stride`-th KV head (drops replicas made for TP)."""
        return jnp.stack([jnp.stack([k[page_ids][..., ::stride, :], v[page_ids][..., ::stride, :]])
                          for k, v in kv_caches])

    @staticmethod
    def _insert_impl(kv_caches, pages, page_ids):
        """Write a block into `page_ids` (out-of-range ids are dropped), replicating heads up to the pool's."""
        r = kv_caches[0][0].shape[2] // pages.shape[4]
        if r > 1:
            pages = jnp.repeat(pages, r, axis=4)
        return [(k.at[page_ids].set(pages[i, 0], mode="drop"), v.at[page_ids].set(pages[i, 1], mode="drop"))
                for i, (k, v) in enumerate(kv_caches)]

    # Host side -----------------------------------------------------------------------------------------------
    def _device_inputs(self, batch: RaggedBatch, num_tokens: int) -> np.ndarray:
        """The ragged batch padded to `num_tokens` tokens and `max_num_seqs` sequences, packed into one int32
        array (one host-to-device copy per step instead of eight; `_unpack` splits it inside the jit).

        Layout: token ids, positions, slots [T each]; logits indices [S]; cu_q_lens [S+1]; kv_lens [S];
        num_seqs, num_decodes; page table [S * P].
        """
        t, s = batch.num_tokens, batch.num_seqs
        n_seq, n_page = self.max_num_seqs, self.pages_per_seq
        packed = np.zeros(3 * num_tokens + 2 * n_seq + self.max_logits_rows + 3 + n_seq * n_page, np.int32)
        tok, pos, slots, idx, cu, kv_lens, counts, table = np.split(packed, self._split_points(num_tokens))
        tok[:t] = batch.token_ids
        pos[:t] = batch.positions
        slots[:] = np.arange(num_tokens, dtype=np.int32) % self.page_size  # padded tokens: trash page 0
        slots[:t] = batch.slot_mapping
        idx[: len(batch.logits_indices)] = batch.logits_indices
        cu[:] = t
        cu[: s + 1] = batch.cu_q_lens
        kv_lens[:s] = batch.kv_lens
        counts[:] = (s, batch.num_decodes)
        table.reshape(n_seq, n_page)[:s, : batch.page_table.shape[1]] = batch.page_table
        return self._put(packed)

    def _split_points(self, num_tokens: int) -> list[int]:
        """Where the packed layout's eight parts start (after the first), for `num_tokens` padded tokens."""
        t, n_seq = num_tokens, self.max_num_seqs
        return np.cumsum([t, t, t, self.max_logits_rows, n_seq + 1, n_seq, 2]).tolist()

    def _unpack(self, packed: jax.Array) -> tuple[jax.Array, jax.Array, AttentionMetadata, jax.Array]:
        """(token ids, positions, metadata, logits indices) from `_device_inputs`' packed array."""
        n_seq, n_page = self.max_num_seqs, self.pages_per_seq
        t = (packed.shape[0] - 2 * n_seq - self.max_logits_rows - 3 - n_seq * n_page) // 3
        tok, pos, slots, idx, cu, kv_lens, counts, table = jnp.split(packed, self._split_points(t))
        meta = AttentionMetadata(slot_mapping=slots, cu_q_lens=cu, kv_lens=kv_lens,
                                 page_table=table.reshape(n_seq, n_page), num_seqs=counts[0], num_decodes=counts[1])
        return tok, pos, meta, idx

    def _put(self, tree: Any) -> Any:
        """Host arrays for a jitted call: as they are within one process (the call's C++ path places them by its
        in_shardings far faster than `jax.device_put`; docs/tuning.md), as global arrays when the mesh spans
        processes."""
        if self._replicated is None or self._replicated.is_fully_addressable:
            return tree
        return jax.tree.map(lambda x: put_global(x, self._replicated), tree)

    def dispatch(self, batch: RaggedBatch, sampling: SamplingArrays, prev: Any = None,
                 prompt_rows: PromptRows | None = None) -> Any:
        """Enqueue the forward and the sampler for `batch`; returns device futures for `collect`.

        `prev` is the previous `dispatch`'s futures when `batch` holds placeholder token ids
        (`core.batch.placeholder`: the token sequence s of that step draws); the forward reads them on the device,
        so the host need not wait. `prompt_rows`: also the logprobs of those prefill rows (prompt_logprobs.py).
        """
        if batch.num_seqs > self.max_num_seqs:
            raise ValueError(f"batch of {batch.num_seqs} sequences exceeds max_num_seqs={self.max_num_seqs}")
        if self.step_hook is not None:
            self.step_hook(batch, sampling)
        num_tokens = bucket_for(batch.num_tokens, self.token_buckets)
        prev_tokens = self._no_prev if prev is None else prev[0]
        forward = self._forward_for(num_tokens) if prompt_rows is None else self.prompt_head.forward_for(num_tokens)
        hidden_rows, *every_row, self.kv_caches = forward(self.param_leaves, self.kv_caches,
                                                          self._device_inputs(batch, num_tokens), prev_tokens)
        rows = self._put((sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.seed,
                          sampling.step, np.bool_(sampling.want_logprobs)))
        drawn = self._sample(self.param_leaves, hidden_rows, *rows, requests=batch.requests)
        return drawn if prompt_rows is None else (*drawn, self.prompt_head.compute(every_row[0], prompt_rows))

    @staticmethod
    def is_ready(pending: Any) -> bool:
        """Whether a dispatched step has finished on the device."""
        return all(x.is_ready() for x in jax.tree.leaves(pending))

    def execute(self, batch: RaggedBatch, sampling: SamplingArrays) -> StepResult:
        """Run the forward for every scheduled token and draw one token per sequence."""
        return self.collect(self.dispatch(batch, sampling), batch, sampling)

    def collect(self, pending: Any, batch: RaggedBatch, sampling: SamplingArrays) -> StepResult:
        """Wait for a dispatched step and copy what it drew to the host (the top logprobs only when asked for)."""
        s = batch.num_seqs
        prompt = _to_host(pending[4]) if len(pending) > 4 else None  # dispatch's prompt_rows
        if not sampling.want_logprobs:
            tokens, logprobs = _to_host(pending[:2])
            return StepResult(tokens[:s], logprobs[:s], None, None, prompt)
        tokens, logprobs, top_ids, top_lp = _to_host(pending[:4])
        return StepResult(tokens[:s], logprobs[:s], top_ids[:s], top_lp[:s], prompt)

    def sampling_bucket(self, num_seqs: int) -> int:
        return bucket_for(num_seqs, self.seq_buckets)

    # KV transfer between pools --------------------------------------------------------------------------------
    def _page_index(self, page_ids: list[int], fill: int, size: int | None = None) -> np.ndarray:
        index = np.full(size or bucket_for(len(page_ids), self.page_buckets), fill, np.int32)
        index[: len(page_ids)] = page_ids
        return index

    def gather_pages(self, page_ids: list[int], unique_heads: int | None = None) -> jax.Array:
        """KV of `page_ids` as one block `[layers, 2, bucket, page_size, heads, head_dim]` (pads: page 0).

        With `unique_heads` (the model's own KV head count), heads replicated for TP are left out.
        """
        pool_heads = self.kv_caches[0][0].shape[2]
        stride = pool_heads // (unique_heads or pool_heads)
        return self._gather(self.kv_caches, self._put(self._page_index(page_ids, 0)), stride)

    def insert_pages(self, pages: jax.Array, page_ids: list[int]) -> None:
        """Write a block from `gather_pages` (already on this pool's devices) into `page_ids` (donated pool)."""
        num_pages = self.kv_caches[0][0].shape[0]
        self.kv_caches = self._insert(self.kv_caches, pages, self._put(self._page_index(page_ids, num_pages,
                                                                                          pages.shape[2])))

    def put_pages(self, pages: jax.Array) -> jax.Array:
        """Move a gathered block onto this pool's devices, sharded on heads (the device-to-device copy)."""
        return jax.device_put(pages, self.pages_sharding(pages.shape))

    def warmup(self) -> None:
        """Compile every token bucket of the forward and every sequence bucket of the sampler."""
        empty = RaggedBatch(requests=[], num_decodes=0, token_ids=np.zeros(0, np.int32),
                            positions=np.zeros(0, np.int32), cu_q_lens=np.zeros(1, np.int32),
                            kv_lens=np.zeros(0, np.int32), page_table=np.zeros((0, 1), np.int32),
                            slot_mapping=np.zeros(0, np.int32), logits_indices=np.zeros(0, np.int32),
                            samples=np.zeros(0, bool))
        hidden_rows = None
        max_len = self.pages_per_seq * self.page_size
        for t in self.token_buckets:
            # Small buckets run real work once: the first execution that runs a bucket's loops costs more (its
            # buffers, its threads), which would land on the first request (docs/tuning.md). Past WARM_REAL_TOKENS
            # that penalty is small beside the step itself and the work would slow start-up, so those buckets only
            # compile (on an empty batch).
            batch = (_trash_prefill(t, self.page_size, self.max_num_seqs, max_len, self.attention.q_blocks)
                     if t <= WARM_REAL_TOKENS else empty)
            hidden_rows, self.kv_caches = self._forward_for(t)(self.param_leaves, self.kv_caches,
                                                               self._device_inputs(batch, t), self._no_prev)
            jax.block_until_ready(hidden_rows)
        for s in self.seq_buckets:
            a = SamplingArrays.build([], s)
            rows = self._put((a.temperature, a.top_k, a.top_p, a.min_p, a.seed, a.step, np.bool_(True)))
            jax.block_until_ready(self._sample.warm(self.param_leaves, hidden_rows, *rows))

    def warmup_transfer(self, unique_heads: int | None = None, *, gather: bool = True, insert: bool = True) -> None:
        """Compile `gather_pages` and/or `insert_pages` for every page-count bucket (disaggregated pools)."""
        pool_heads = self.kv_caches[0][0].shape[2]
        for n in self.page_buckets:
            if gather:
                jax.block_until_ready(self.gather_pages([0] * n, unique_heads))
            if insert:
                k = self.kv_caches[0][0]
                shape = (len(self.kv_caches), 2, n, k.shape[1], unique_heads or pool_heads, k.shape[3])
                block = jnp.zeros(shape, k.dtype, device=self.pages_sharding(shape))
                self.insert_pages(block, [])
        jax.block_until_ready(self.kv_caches)

    def _forward_for(self, num_tokens: int) -> Callable:
        """The jitted forward for a `num_tokens` bucket (see CPU_SEPARATE_DOTS_ABOVE)."""
        return self._forward_wide if num_tokens > CPU_SEPARATE_DOTS_ABOVE else self._forward

    def compile_count(self) -> int:
        """Compiled variants of the step functions so far (grows only when a new shape appears)."""
        fns = {id(f): f for f in (self._forward, self._forward_wide, self._sample, self._gather, self._insert)}
        return sum(f._cache_size() for f in fns.values()) + self.prompt_head.compile_count()


def _trash_prefill(num_tokens: int, page_size: int, max_seqs: int = 1, max_len: int = 0,
                   q_blocks: tuple[int, ...] = (1,)) -> RaggedBatch:
    """Warm-up work whose KV all lives in the trash page 0.

    One decode, a prefill chunk for each of the smaller sizes of `q_blocks` (the attention backend's, largest
    first) and one prefill of the rest (as many as `max_seqs` and `num_tokens` allow), all after a history of up
    to WARM_HISTORY tokens that fits in `max_len`: the loops of the bucket's attention run once (decode blocks,
    query blocks, masked and unmasked KV blocks). A loop's first run costs extra (its buffers, its threads),
    which would otherwise land on a request.
    """
    history = max(0, min(WARM_HISTORY, max_len - num_tokens))
    q_lens = [num_tokens]
    for first in (1, *sorted(q_blocks[1:])):
        if len(q_lens) < max_seqs and q_lens[-1] > first:
            q_lens[-1:] = [first, q_lens[-1] - first]
    decodes = int(len(q_lens) > 1)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    positions = np.concatenate([history + np.arange(q) for q in q_lens]).astype(np.int32)
    n = len(q_lens)
    return RaggedBatch(requests=[None] * n, num_decodes=decodes,  # type: ignore[list-item]
                       token_ids=np.zeros(num_tokens, np.int32), positions=positions, cu_q_lens=cu,
                       kv_lens=np.array([history + q for q in q_lens], np.int32),
                       page_table=np.zeros((n, 1), np.int32),
                       slot_mapping=np.arange(num_tokens, dtype=np.int32) % page_size,
                       logits_indices=cu[1:] - 1, samples=np.ones(n, bool))


def _to_host(xs: Sequence[jax.Array]) -> list[np.ndarray]:
    """Replicated device arrays on the host, in one transfer (this process's copies when the mesh spans
    processes): one `device_get` for all, not one per array."""
    if all(x.is_fully_addressable for x in xs):
        return [np.asarray(x) for x in jax.device_get(list(xs))]
    return [np.asarray(x.addressable_data(0)) for x in xs]

