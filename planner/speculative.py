"""Speculative decoding in the step model: what a verify step costs, what the proposer costs, and the TPOT.

A proposer guesses k tokens; the target checks them in one step whose sequences each run a chunk of k + 1 query
rows (the last token and the k drafts) and draw from every row. With each draft accepted independently with
probability a, a verify step emits E = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens (the accepted
prefix and one more). So

    TPOT = (verify step + proposer) / E

where the verify step is the roofline step model's step with k + 1 rows per sequence (its matmuls read the
weights once for all rows, so on a bandwidth-bound device it costs little more than a decode step), and the
proposer is ~0 for n-gram lookup (host work, whose proposals go up with the verify step's inputs) or, for a draft
model, its own k steps: one forward over the sequences' newest tokens, then k - 1 decode iterations, each with its
LM head and sampling. They are priced as --num-scheduler-steps prices k decode steps in one dispatch: one
`dispatch_overhead_s` for the k, the rest of each step's costs k times (each step less the dispatch's host work, at
most its fitted fixed overhead where a profile's fit left less there than the dispatch measured). A round of
decodes now runs the draft's steps and the verify step in one jitted call (jaxserve/spec_decode/round.py), yet the
round keeps that dispatch in its price: on the 2-core EPYC the one call saved far less than a calibrated dispatch
(docs/speculative.md: the report's row -30.9% priced without it, -11.6% with it, the same run). The verify step runs
its k + 1 rows a sequence unpadded (the round is compiled per sequence bucket).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from modelspec.spec import ModelSpec
from planner.hardware import Hardware
from planner.step_model import (
    LM_HEAD,
    StepShape,
    decode_shape,
    op_costs,
    pad_tokens,
    prefill_shape,
    step_time_shape,
    time_ops,
)

METHODS = ("ngram", "draft_model")


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Tokens a verify step emits when each of k drafts is accepted with probability `acceptance`."""
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if k < 0:
        raise ValueError(f"k must be non-negative, got {k}")
    if acceptance == 1:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def acceptance_from_tokens_per_step(tokens_per_step: float, k: int) -> float:
    """The per-draft acceptance a whose `expected_tokens_per_step(a, k)` is the measured mean (bisection)."""
    if not 1 <= tokens_per_step <= k + 1:
        raise ValueError(f"tokens per verify step must be in [1, {k + 1}], got {tokens_per_step}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < tokens_per_step else (lo, mid)
    return (lo + hi) / 2


def verify_shape(batch: int, context_len: float, k: int) -> StepShape:
    """`batch` sequences, each verifying k drafts after `context_len` cached tokens: a chunk of k + 1 rows."""
    shape = StepShape()
    for _ in range(batch):
        shape = shape + prefill_shape(k + 1, context_len)
    return shape


def verify_step_s(spec: ModelSpec, hw: Hardware, batch: int, context_len: float, k: int, *, tp: int = 1,
                  dtype: str = "bf16", kv_dtype: str | None = None, token_buckets: Sequence[int] = ()) -> float:
    """Seconds of one verify step: the step model of `verify_shape`, with the LM head and the sampler over every
    row (batch x (k + 1)) instead of one per sequence, unpadded but to the smallest of `token_buckets`."""
    shape = verify_shape(batch, context_len, k)
    rows = batch * (k + 1)
    padded = max(shape.num_tokens, min(token_buckets, default=1))  # a round's rows, not a forward's bucket
    ops = []
    for op in op_costs(spec, shape, tp=tp, dtype=dtype, kv_dtype=kv_dtype, padded_tokens=padded):
        if op.name in (LM_HEAD, "sampling"):
            f = rows / max(shape.num_seqs, 1)
            op = replace(op, flops=op.flops * f, act_bytes=op.act_bytes * f, comm_bytes=op.comm_bytes * f,
                         gemm_rows=op.gemm_rows * f if op.gemm_rows else 0)
        ops.append(op)
    return time_ops(ops, spec, shape, hw, tp=tp, dtype=dtype, padded_tokens=padded).total_s


def proposer_s(method: str, hw: Hardware, batch: int, context_len: float, k: int, *,
               draft: ModelSpec | None = None, tp: int = 1, dtype: str = "bf16", kv_dtype: str | None = None,
               token_buckets: Sequence[int] = ()) -> float:
    """Seconds the proposer spends per verify step: 0 for n-gram lookup (host work, beside the step's own), k
    draft-model decode steps of `batch` sequences in one dispatch for a draft model."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "ngram":
        return 0.0
    if draft is None:
        raise ValueError("a draft_model proposer needs the draft model's spec")
    host = max(hw.coefficients.dispatch_overhead_s, 0.0)
    kw = dict(tp=tp, dtype=dtype, kv_dtype=kv_dtype, padded_tokens=pad_tokens(batch, token_buckets))
    total = host  # the host prepares and collects the k steps once
    for i in range(k):
        alone = step_time_shape(draft, hw, decode_shape(batch, context_len + i), **kw)
        # Each step's own work: the step less its share of a dispatch's host work, which lives in its fitted fixed
        # overhead (a fit can leave less there than the dispatch measured: then that much is taken).
        total += alone.total_s - min(host, max(alone.overhead_s, 0.0))
    return total


@dataclass(frozen=True)
class SpeculativePrediction:
    """TPOT with and without speculation at one batch size and context length (seconds)."""

    method: str
    k: int
    acceptance: float
    tokens_per_step: float
    verify_step_s: float
    proposer_s: float
    decode_step_s: float  # a plain decode step: the TPOT without speculation
    tpot_s: float

    @property
    def speedup(self) -> float:
        return self.decode_step_s / self.tpot_s if self.tpot_s > 0 else math.inf

    def to_json(self) -> dict[str, float | int | str]:
        return {"method": self.method, "k": self.k, "acceptance": self.acceptance,
                "tokens_per_step": self.tokens_per_step, "verify_step_ms": self.verify_step_s * 1e3,
                "proposer_ms": self.proposer_s * 1e3, "decode_step_ms": self.decode_step_s * 1e3,
                "tpot_ms": self.tpot_s * 1e3, "speedup": self.speedup}


def predict_speculative(spec: ModelSpec, hw: Hardware, *, k: int, acceptance: float, method: str = "draft_model",
                        draft: ModelSpec | None = None, batch: int = 1, context_len: float = 512, tp: int = 1,
                        dtype: str = "bf16", kv_dtype: str | None = None, token_buckets: Sequence[int] = (),
                        tokens_per_step: float | None = None) -> SpeculativePrediction:
    """TPOT of `batch` sequences at `context_len` with k drafts per step accepted with probability `acceptance`
    (or, given `tokens_per_step`, a measured mean instead of the i.i.d. expectation)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    kw = dict(tp=tp, dtype=dtype, kv_dtype=kv_dtype, token_buckets=token_buckets)
    e = tokens_per_step if tokens_per_step is not None else expected_tokens_per_step(acceptance, k)
    verify = verify_step_s(spec, hw, batch, context_len, k, **kw)
    proposer = proposer_s(method, hw, batch, context_len, k, draft=draft, **kw)
    decode = step_time_shape(spec, hw, decode_shape(batch, context_len), tp=tp, dtype=dtype, kv_dtype=kv_dtype,
                             padded_tokens=pad_tokens(batch, token_buckets)).total_s
    return SpeculativePrediction(method=method, k=k, acceptance=acceptance, tokens_per_step=e, verify_step_s=verify,
                                 proposer_s=proposer, decode_step_s=decode, tpot_s=(verify + proposer) / e)


def choose_k(spec: ModelSpec, hw: Hardware, *, acceptance: float, max_k: int = 8, **kwargs) -> SpeculativePrediction:
    """The k (1..max_k) with the lowest predicted TPOT (`predict_speculative`'s other arguments as keywords)."""
    preds = [predict_speculative(spec, hw, k=k, acceptance=acceptance, **kwargs) for k in range(1, max_k + 1)]
    return min(preds, key=lambda p: p.tpot_s)
