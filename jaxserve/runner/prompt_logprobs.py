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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.batch import RaggedBatch
from jaxserve.runner.compiles import compiled_variants
from jaxserve.runner.sampling import NUM_TOP_LOGPROBS

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
    target_lp, *top = values  # the top ids and logprobs only when some owner asked for k > 0
    for r, s in enumerate(rows.owners):
        entry = {int(rows.targets[r]): float(target_lp[r])}
        k = batch.requests[s].sampling_params.prompt_logprobs or 0
        if k:
            top_ids, top_lp = top
            entry.update(zip(top_ids[r, :k].tolist(), top_lp[r, :k].tolist(), strict=True))
        filled[s][int(rows.positions[r]) + 1] = entry


class PromptHead:
    """The LM head + log-softmax over the asked-for prompt rows of one `ModelRunner`'s step (the runner's forward
    with every row's hidden state gives them), jitted on first use in two variants: with and without the top
    logprobs (decided on the host, no conditional on the device)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._heads: dict[bool, Callable] = {}

    def _call(self, hidden: jax.Array, rows: PromptRows) -> tuple[Any, tuple]:
        r = self.runner
        want_top = bool(rows.want_top)
        if want_top not in self._heads:
            self._heads[want_top] = r.jit_step(functools.partial(self._head_impl, want_top), num_inputs=3,
                                               num_outputs=3 if want_top else 1, pool=False)
        size = next(b for b in r.token_buckets if b >= rows.num_rows)  # rows <= the step's tokens
        idx, tgt = np.zeros(size, np.int32), np.zeros(size, np.int32)
        idx[: rows.num_rows], tgt[: rows.num_rows] = rows.indices, rows.targets
        return self._heads[want_top], (r.param_leaves, hidden, *r.put((idx, tgt)))

    def compute(self, hidden: jax.Array, rows: PromptRows) -> tuple[jax.Array, ...]:
        """Device futures (target logprob [R'], top ids [R', K], top logprobs [R', K]; the top arrays only when
        asked for) for `rows` of `hidden`, the rows padded to a token bucket R' (padding rows read row 0 and are
        dropped by `record`)."""
        fn, args = self._call(hidden, rows)
        out = fn(*args)
        return out if rows.want_top else (out,)

    def lower(self, hidden: jax.Array, rows: PromptRows) -> Any:
        """What `compute` would run, lowered for these arguments (to read its program; nothing runs)."""
        fn, args = self._call(hidden, rows)
        return fn.lower(*args)

    def _head_impl(self, want_top: bool, param_leaves, hidden, indices, targets):
        r = self.runner
        logits = r.model(param_leaves).compute_logits(hidden[indices], r.ops.matmul)
        logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        target = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
        if not want_top:
            return target
        top_lp, top_ids = jax.lax.top_k(logp, min(NUM_TOP_LOGPROBS, logits.shape[-1]))
        return target, top_ids, top_lp

    def compile_count(self) -> int:
        """Compiled variants so far (0 until a request asks for prompt logprobs)."""
        return compiled_variants(self._heads.values())
