"""Runs one ragged batch on the device: pad to a bucket, one jitted forward, one jitted sample.

The forward is compiled once per token bucket (the sequence axis of the metadata is always padded to
`max_num_seqs`, and attention loops only over the real sequences); the sampler once per sequence bucket and
variant (sampler.py). The KV pool is donated to the forward, so XLA updates it in place. Warm-up compiles every
bucket at start-up; `compile_count()` lets tests assert that nothing compiles afterwards. Every device-dependent
choice (attention backend, matmul route, the sampler's cut, compiler options) comes from the platform policy the
runner is given.

The public face its helpers use (the k-step decode run, prompt logprobs, speculative decoding's draft and
verifier, KV transfer): `model(leaves)` (the model bound to parameter leaves, inside a jit), `ops`, `put`,
`jit_step` (a function of the parameters and the pool, jitted with this runner's shardings), `device_inputs`,
`forward_fn` and `forward`. `dispatch` and `collect` split a step so a caller can keep steps in flight.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxserve.core import progress
from jaxserve.core.batch import RaggedBatch, empty_batch, is_placeholder, placeholder_seq, trash_prefill
from jaxserve.model.ops import ModelOps
from jaxserve.platform.policy import PlatformPolicy
from jaxserve.runner.buckets import bucket_for, power_of_two_ladder
from jaxserve.runner.compiles import compiled_variants
from jaxserve.runner.page_transfer import PageMover
from jaxserve.runner.parallel import params_shardings, put_global, replicated
from jaxserve.runner.prompt_logprobs import PromptHead, PromptRows
from jaxserve.runner.sampler import Sampler, SamplingArrays
from jaxserve.runner.step_inputs import StepLayout

WARM_REAL_TOKENS = 512  # warm-up runs buckets up to this size once with real work
WARM_HISTORY = 544  # ...after this many tokens of (trash) history: past a 512-token decode block, 256-token KV blocks

logger = logging.getLogger(__name__)


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

    def __init__(self, model: nnx.Module, kv_caches, policy: PlatformPolicy, *, page_size: int, max_model_len: int,
                 max_num_seqs: int, token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...],
                 max_logits_rows: int = 0) -> None:
        self.graphdef, self.params = nnx.split(model)
        # The jitted calls take the parameters as a flat list: the nnx State flattens in Python on every call (two
        # calls a step), a list of arrays in C++ (docs/tuning.md).
        self.param_leaves, self._param_tree = jax.tree.flatten(self.params)
        self.kv_caches = kv_caches
        self.policy = policy
        self.page_size = page_size
        self.max_num_seqs, self.max_logits_rows = max_num_seqs, max(max_logits_rows, max_num_seqs)  # + verify rows
        self.pages_per_seq = math.ceil(max_model_len / page_size)
        self.token_buckets = token_buckets
        self.seq_buckets = seq_buckets
        self.page_buckets = power_of_two_ladder(self.pages_per_seq)
        self.layout = StepLayout(page_size, max_num_seqs, self.pages_per_seq, self.max_logits_rows)
        # The sampler pads its tokens to this length so the next forward, which may read them on the device
        # (asynchronous scheduling), has one input shape whatever the sequence bucket.
        self.max_sampled = max(seq_buckets)
        self.step_hook: Callable[[RaggedBatch, SamplingArrays], None] | None = None  # multi-host: announce steps
        sharding = kv_caches[0][0].sharding
        self.mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
        self.replicated = replicated(self.mesh) if self.mesh is not None else sharding
        # (wide bucket, every row's hidden state, decodes only) -> jit
        self._forwards: dict[tuple[bool, bool, bool], Callable] = {}
        self.sampler = Sampler(self)
        self.prompt_head = PromptHead(self)  # jitted on first use
        self.pages = PageMover(self)
        # A device array like the sampler's output: a numpy array here would be a second jit variant of the
        # forward, compiled on the first step that reads a previous step's tokens.
        self.no_prev = jnp.zeros(self.max_sampled, jnp.int32, device=self.replicated)

    @property
    def ops(self) -> ModelOps:
        """The model's attention backend and matmul route (the policy's)."""
        return self.policy.ops

    # The public face of the runner's helpers ----------------------------------------------------------------
    def model(self, param_leaves: list | None = None) -> nnx.Module:
        """The model bound to `param_leaves` (this runner's own by default; inside a jit, the traced ones)."""
        leaves = self.param_leaves if param_leaves is None else param_leaves
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._param_tree, leaves))

    def put(self, tree: Any) -> Any:
        """Host arrays for a jitted call: as they are within one process (the call's C++ path places them by its
        in_shardings far faster than `jax.device_put`; docs/tuning.md), as global arrays when the mesh spans
        processes."""
        if self.mesh is None or self.replicated.is_fully_addressable:
            return tree
        return jax.tree.map(lambda x: put_global(x, self.replicated), tree)

    def jit_step(self, fn: Callable, *, num_inputs: int, num_outputs: int, pool: bool = True,
                 compiler_options: dict | None = None) -> Callable:
        """`fn(param_leaves, [kv_caches,] *inputs) -> (*outputs[, kv_caches])` jitted with this runner's shardings:
        parameters per the tensor-parallel table, the pool (donated, when `pool`) on KV heads, every input and
        output replicated."""
        kw: dict[str, Any] = dict(compiler_options=compiler_options) if compiler_options else {}
        if pool:
            kw["donate_argnums"] = (1,)
        if self.mesh is None:
            return jax.jit(fn, **kw)
        rep = self.replicated
        kv_sh = [jax.tree.map(lambda x: x.sharding, self.kv_caches)] if pool else []
        outs = (rep,) * num_outputs + tuple(kv_sh)
        return jax.jit(fn, in_shardings=(jax.tree.leaves(params_shardings(self.params)), *kv_sh,
                                         *(rep,) * num_inputs), out_shardings=outs if len(outs) > 1 else outs[0],
                       **kw)

    def device_inputs(self, batch: RaggedBatch, num_tokens: int) -> Any:
        """`batch` packed for a `num_tokens` bucket (`StepLayout.pack`), placed for the jitted call."""
        return self.put(self.layout.pack(batch, num_tokens))

    def _forward_impl(self, all_rows: bool, decode_only: bool, param_leaves, kv_caches, packed, prev_tokens):
        token_ids, positions, meta, logits_indices = self.layout.unpack(packed)
        # A placeholder stands for what a sequence of the previous step drew, still on the device.
        drawn = prev_tokens[jnp.clip(placeholder_seq(token_ids), 0, prev_tokens.shape[0] - 1)]
        token_ids = jnp.where(is_placeholder(token_ids), drawn, token_ids)
        ops = self.policy.ops_for(decode_only)
        hidden, kv_caches = self.model(param_leaves)(token_ids, positions, kv_caches, meta, ops)
        return (hidden[logits_indices], hidden, kv_caches) if all_rows else (hidden[logits_indices], kv_caches)

    def forward_fn(self, num_tokens: int, *, all_rows: bool = False, decode_only: bool = False,
                   fresh: bool = False) -> Callable:
        """The jitted forward of a `num_tokens` bucket: (param leaves, pool, packed inputs, previous tokens) ->
        (logits rows' hidden states, [every row's,] pool). `decode_only`: the variant for a step of decodes only
        (the policy's `decode_ops`; the same as the other where it has none). `fresh`: a new jit, traced with the
        policy as it is when first called (tools comparing backends), not the engine's compiled one."""
        options = self.policy.compiler_options(num_tokens)
        decode_only = decode_only and self.policy.decode_ops is not None
        key = (options is not None, all_rows, decode_only)
        if fresh or key not in self._forwards:
            fn = self.jit_step(lambda *a: self._forward_impl(all_rows, decode_only, *a), num_inputs=2,
                               num_outputs=2 if all_rows else 1, compiler_options=options)
            if fresh:
                return fn
            self._forwards[key] = fn
        return self._forwards[key]

    def forward(self, batch: RaggedBatch, *, prev: jax.Array | None = None, all_rows: bool = False) -> Any:
        """Run the forward for `batch` (its KV written into the pool); returns the hidden states of its logits rows
        (and of every row, with `all_rows`), on the device. `prev`: the tokens a step in flight draws, which
        `batch`'s placeholders stand for."""
        t = bucket_for(batch.num_tokens, self.token_buckets)
        decode_only = batch.num_seqs > 0 and batch.num_prefill_tokens == 0  # host-known: picks the variant
        *hidden, self.kv_caches = self.forward_fn(t, all_rows=all_rows, decode_only=decode_only)(
            self.param_leaves, self.kv_caches, self.device_inputs(batch, t), self.no_prev if prev is None else prev)
        return tuple(hidden) if all_rows else hidden[0]

    def trace_forward(self, batch: RaggedBatch, num_tokens: int) -> Any:
        """The forward body of a `num_tokens` bucket traced afresh (with the policy as it is now) from `batch`'s
        shapes alone: `.lower(lowering_platforms=("cuda",))` shows what a GPU would run, without one."""
        args = (self.param_leaves, self.kv_caches, self.device_inputs(batch, num_tokens), self.no_prev)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
        return jax.jit(lambda *a: self._forward_impl(False, False, *a)).trace(*shapes)

    def lower_forward(self, batch: RaggedBatch, num_tokens: int) -> Any:
        """The forward of a `num_tokens` bucket lowered for `batch` (to read its HLO; nothing runs)."""
        return self.forward_fn(num_tokens).lower(self.param_leaves, self.kv_caches,
                                                 self.device_inputs(batch, num_tokens), self.no_prev)

    # Steps ----------------------------------------------------------------------------------------------------
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
        prev_tokens = None if prev is None else prev[0]
        if prompt_rows is None:
            return self.sampler(self.forward(batch, prev=prev_tokens), sampling, batch.requests)
        hidden_rows, every_row = self.forward(batch, prev=prev_tokens, all_rows=True)
        drawn = self.sampler(hidden_rows, sampling, batch.requests)
        return (*drawn, *((None, None) if len(drawn) == 2 else ()), self.prompt_head.compute(every_row, prompt_rows))

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
        prompt = to_host(pending[4]) if len(pending) > 4 else None  # dispatch's prompt_rows
        if not sampling.want_logprobs:
            tokens, logprobs = to_host(pending[:2])
            return StepResult(tokens[:s], logprobs[:s], None, None, prompt)
        tokens, logprobs, top_ids, top_lp = to_host(pending[:4])
        return StepResult(tokens[:s], logprobs[:s], top_ids[:s], top_lp[:s], prompt)

    def sampling_bucket(self, num_seqs: int) -> int:
        return bucket_for(num_seqs, self.seq_buckets)

    # KV transfer between pools (page_transfer.py) ---------------------------------------------------------------
    def gather_pages(self, page_ids: list[int], unique_heads: int | None = None) -> jax.Array:
        """KV of `page_ids` as one block `[layers, 2, bucket, page_size, heads, head_dim]` (`PageMover.gather`)."""
        return self.pages.gather(page_ids, unique_heads)

    def insert_pages(self, pages: jax.Array, page_ids: list[int]) -> None:
        """Write a block from `gather_pages`, already on this pool's devices, into `page_ids`."""
        self.pages.insert(pages, page_ids)

    def put_pages(self, pages: jax.Array) -> jax.Array:
        """Move a gathered block onto this pool's devices, sharded on heads."""
        return self.pages.put(pages)

    def warmup_transfer(self, unique_heads: int | None = None, *, gather: bool = True, insert: bool = True) -> None:
        """Compile `gather_pages` and/or `insert_pages` for every page-count bucket (disaggregated pools)."""
        self.pages.warmup(unique_heads, gather=gather, insert=insert)

    # Start-up ---------------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile every token bucket of the forward and every sequence bucket and variant of the sampler."""
        max_len = self.pages_per_seq * self.page_size
        hidden_rows = None
        task = "compiling the forward step, one per token bucket"
        n = len(self.token_buckets)
        for i, t in enumerate(self.token_buckets):
            logger.info("%s: %d tokens (%d of %d)", task, t, i + 1, n, extra=progress.step(task, i, n))
            # Small buckets run real work once: the first execution that runs a bucket's loops costs more (its
            # buffers, its threads), which would land on the first request (docs/tuning.md). Past WARM_REAL_TOKENS
            # that penalty is small beside the step itself and the work would slow start-up, so those buckets only
            # compile (on an empty batch).
            batch = (trash_prefill(t, self.page_size, self.max_num_seqs, max_len, self.ops.attention.q_blocks,
                                   WARM_HISTORY) if t <= WARM_REAL_TOKENS else empty_batch())
            hidden_rows, self.kv_caches = self.forward_fn(t)(self.param_leaves, self.kv_caches,
                                                             self.device_inputs(batch, t), self.no_prev)
            jax.block_until_ready(hidden_rows)
            if self.policy.decode_ops is not None and t <= self.max_num_seqs:  # a step of decodes only fits
                _, self.kv_caches = self.forward_fn(t, decode_only=True)(
                    self.param_leaves, self.kv_caches, self.device_inputs(empty_batch(), t), self.no_prev)
        logger.info("%s: done", task, extra=progress.step(task, n, n))
        self.sampler.warmup(hidden_rows)

    def compile_count(self) -> int:
        """Compiled variants of the step functions so far (grows only when a new shape appears)."""
        return (compiled_variants(self._forwards.values()) + self.sampler.compile_count()
                + self.prompt_head.compile_count() + self.pages.compile_count())


def to_host(xs: Sequence[jax.Array]) -> list[np.ndarray]:
    """Replicated device arrays on the host, in one transfer (this process's copies when the mesh spans
    processes): one `device_get` for all, not one per array."""
    if all(x.is_fully_addressable for x in xs):
        return [np.asarray(x) for x in jax.device_get(list(xs))]
    return [np.asarray(x.addressable_data(0)) for x in xs]
