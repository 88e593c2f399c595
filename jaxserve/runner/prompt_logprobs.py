"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): full-vocabulary log-softmax of prefill rows.

Contract (what `RequestOutput.prompt_logprobs` holds; the server's `echo`/`prompt_logprobs` build on it):

- `SamplingParams.prompt_logprobs = None` (the default): nothing is computed, the step runs exactly as before.
  `k` in [0, 20]: `RequestOutput.prompt_logprobs` is a list of `len(prompt_token_ids)` entries. Entry 0 is None
  (the first token has no context); entry j >= 1 is a dict `{token_id: logprob}` holding the prompt's own token
  `prompt_token_ids[j]` with log p(token_j | tokens_<j), plus, for k > 0, the k most likely tokens at that
  position (so a dict has k or k + 1 keys). Logprobs are of the model's raw distribution (no temperature or
  filters), in float32, like the generated tokens' `logprobs`.
- Computed inside the jitted step from the rows of each prefill chunk: a chunk of a prompt contributes the entries
  its tokens predict, so chunked and unchunked prefill give the same list. Only steps that hold such rows run the
  forward variant that keeps every row's hidden state, and only those rows go through the LM head and the
  log-softmax; each token bucket's variant (and each row bucket's head) compiles on its first use.
- The prefix cache: a request that asks for prompt logprobs does not reuse cached KV (`KVCacheManager.admit`),
  so every prompt token's row is computed (its pages are still cached for others). After a preemption the
  prompt is recomputed, but entries already filled are not asked for again.
- A list is complete in every output that carries a generated token; an output of a request aborted during its
  prefill may hold None for the entries not computed yet. Not supported (refused at `add_request`) by the
  disaggregated and the multi-host engines.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.core.batch import RaggedBatch
from jaxserve.runner.parallel import params_shardings
from jaxserve.runner.sampler import NUM_TOP_LOGPROBS

PromptLogprobs = list[dict[int, float] | None]


@dataclass
class PromptRows:
    """The prefill rows of one step whose logprobs are asked for.

    Row r is the flat token index `indices[r]` of the batch; its logits score `targets[r]`, the prompt token at
    position `positions[r] + 1` of request `owners[r]`'s prompt. `want_top` when some owner asks for k > 0.
    """

    indices: np.ndarray  # [R] int32
    targets: np.ndarray  # [R] int32
    owners: list[int]  # [R] sequence index in the batch
    positions: np.ndarray  # [R] int32, the position of the row's input token
    want_top: bool

    @property
    def num_rows(self) -> int:
        return int(self.indices.shape[0])


def plan_rows(batch: RaggedBatch, filled: dict[int, PromptLogprobs]) -> PromptRows | None:
    """The rows of `batch` whose prompt logprobs are still missing; `filled` maps a sequence index to its request's
    list (sequences not in it ask for none). None when no row is needed (the common case: nothing to add)."""
    if not filled:
        return None
    idx, tgt, own, pos = [], [], [], []
    for s, lst in filled.items():
        req = batch.requests[s]
        q = int(batch.cu_q_lens[s + 1] - batch.cu_q_lens[s])
        start = int(batch.kv_lens[s]) - q
        # Row at position p predicts prompt token p + 1; the prompt's last row predicts the first output.
        ps = [p for p in range(start, min(start + q, len(req.prompt_token_ids) - 1)) if lst[p + 1] is None]
        idx += [int(batch.cu_q_lens[s]) + p - start for p in ps]
        tgt += [req.prompt_token_ids[p + 1] for p in ps]
        own += [s] * len(ps)
        pos += ps
    if not idx:
        return None
    want_top = any(batch.requests[s].sampling_params.prompt_logprobs for s in filled)
    return PromptRows(np.array(idx, np.int32), np.array(tgt, np.int32), own, np.array(pos, np.int32), want_top)


def record(rows: PromptRows, values: list[np.ndarray], batch: RaggedBatch, filled: dict[int, PromptLogprobs]) -> None:
    """Write a step's prompt logprobs (`PromptHead.compute`'s arrays, on the host) into each owner's list."""
    target_lp, top_ids, top_lp = values
    for r, s in enumerate(rows.owners):
        entry = {int(rows.targets[r]): float(target_lp[r])}
        k = batch.requests[s].sampling_params.prompt_logprobs or 0
        if k:
            entry.update(zip(top_ids[r, :k].tolist(), top_lp[r, :k].tolist(), strict=True))
        filled[s][int(rows.positions[r]) + 1] = entry


class PromptHead:
    """The jitted parts of prompt logprobs for one `ModelRunner`: its forward variant that also returns every
    row's hidden state, and the LM head + log-softmax over the asked-for rows. Built on first use."""

    def __init__(self, runner, wide_options: dict) -> None:
        self.runner = runner
        self.wide_options = wide_options  # the runner's compiler options for its widest buckets
        self._forwards: dict[bool, Callable] = {}
        self._head: Callable | None = None

    def forward_for(self, num_tokens: int) -> Callable:
        """The forward for a `num_tokens` bucket returning (last rows, all rows' hidden states, KV caches)."""
        r = self.runner
        wide = r._forward_for(num_tokens) is not r._forward
        if wide not in self._forwards:
            body = functools.partial(r._forward_impl, all_rows=True)
            self._forwards[wide] = jax.jit(body, donate_argnums=(1,), **self._shardings(wide))
        return self._forwards[wide]

    def _shardings(self, wide: bool) -> dict:
        r = self.runner
        out = dict(compiler_options=self.wide_options) if wide else {}
        if r.mesh is not None:
            rep, kv_sh = r._replicated, jax.tree.map(lambda x: x.sharding, r.kv_caches)
            out.update(in_shardings=(jax.tree.leaves(params_shardings(r.params)), kv_sh, rep, rep),
                       out_shardings=(rep, rep, kv_sh))
        return out

    def compute(self, hidden: jax.Array, rows: PromptRows) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Device futures (target logprob [R'], top ids [R', K], top logprobs [R', K]) for `rows` of `hidden`, the
        rows padded to a token bucket R' (padding rows read row 0 and are dropped by `record`)."""
        r = self.runner
        if self._head is None:
            kw = {} if r.mesh is None else dict(out_shardings=r._replicated)
            self._head = jax.jit(self._head_impl, **kw)
        size = next(b for b in r.token_buckets if b >= rows.num_rows)  # rows <= the step's tokens
        idx, tgt = np.zeros(size, np.int32), np.zeros(size, np.int32)
        idx[: rows.num_rows], tgt[: rows.num_rows] = rows.indices, rows.targets
        return self._head(r.param_leaves, hidden, *r._put((idx, tgt, np.bool_(rows.want_top))))

    def _head_impl(self, param_leaves, hidden, indices, targets, want_top):
        r = self.runner
        model = nnx.merge(r.graphdef, jax.tree.unflatten(r._param_tree, param_leaves))
        logits = model.compute_logits(hidden[indices], cpu_kernel=r.cpu_kernels, plan=r.kernel_plan)
        logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        target = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
        k = min(NUM_TOP_LOGPROBS, logits.shape[-1])
        top_lp, top_ids = jax.lax.cond(
            want_top, lambda: tuple(jax.lax.top_k(logp, k)),
            lambda: (jnp.zeros((logp.shape[0], k), logp.dtype), jnp.zeros((logp.shape[0], k), jnp.int32)))
        return target, top_ids, top_lp

    def compile_count(self) -> int:
        """Compiled variants so far (0 until a request asks for prompt logprobs)."""
        fns = [*self._forwards.values(), *([self._head] if self._head is not None else [])]
        return sum(f._cache_size() for f in fns)
