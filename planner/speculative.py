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
LM head and sampling.

A round of decodes is one dispatch (jaxserve/spec_decode/round.py: the draft's steps, the target's verify forward
and the acceptance in one jitted call), so it pays one step's fixed overhead (`step_overhead_s`, the host's
scheduling and dispatch among it), the verify step's: each draft step is priced as its step less that overhead
(its layers' and its sequences' overheads stay: they run on the device). The verify step runs its k + 1 rows a
sequence unpadded (the round is compiled per sequence bucket). Its LM head reads the embedding once for all rows:
the S sequences' rows are priced as a decode step's LM head (whose fitted rate, on a CPU profile, also holds what
each decode sequence costs beside its row: the fit cannot tell them apart), the S k draft rows as GEMM rows of
the projections' rate. docs/speculative.md ("Pricing the round") has the measurements behind both choices.
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
# A verify step's LM head over its draft rows: the embedding is already read for the sequences' rows (LM_HEAD), so
# these are GEMM rows only, priced at the projections' rate rather than the LM head's (see the module docstring).
DRAFT_ROWS_HEAD = "lm_head_draft_rows"


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
    """Seconds of one verify step (a round's one dispatch): the step model of `verify_shape`, unpadded but to the
    smallest of `token_buckets`; its LM head and sampler draw from every row (batch x (k + 1)): the batch's rows
    at the LM head's price, the batch x k draft rows at a GEMM's (`DRAFT_ROWS_HEAD`)."""
    shape = verify_shape(batch, context_len, k)
    padded = max(shape.num_tokens, min(token_buckets, default=1))  # a round's rows, not a forward's bucket
    ops = []
    for op in op_costs(spec, shape, tp=tp, dtype=dtype, kv_dtype=kv_dtype, padded_tokens=padded):
        # op_costs counts the LM head and the sampler once a sequence: the draft rows are k more each
        if op.name == LM_HEAD:
            ops.append(replace(op, name=DRAFT_ROWS_HEAD, flops=op.flops * k, weight_bytes=0.0,
                               act_bytes=op.act_bytes * k, comm_bytes=op.comm_bytes * k, gemm_rows=batch * (k + 1)))
        elif op.name == "sampling":
            op = replace(op, flops=op.flops * (k + 1), act_bytes=op.act_bytes * (k + 1))
        ops.append(op)
    return time_ops(ops, spec, shape, hw, tp=tp, dtype=dtype, padded_tokens=padded).total_s


def proposer_s(method: str, hw: Hardware, batch: int, context_len: float, k: int, *,
               draft: ModelSpec | None = None, tp: int = 1, dtype: str = "bf16", kv_dtype: str | None = None,
               token_buckets: Sequence[int] = ()) -> float:
    """Seconds the proposer adds to a round: 0 for n-gram lookup (host work, beside the step's own); for a draft
    model, its k decode steps of `batch` sequences, each less the step's fixed overhead (the round's one dispatch
    pays it, in the verify step)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "ngram":
        return 0.0
    if draft is None:
        raise ValueError("a draft_model proposer needs the draft model's spec")
    fixed = max(hw.coefficients.step_overhead_s, 0.0)
    kw = dict(tp=tp, dtype=dtype, kv_dtype=kv_dtype, padded_tokens=pad_tokens(batch, token_buckets))
    total = 0.0
    for i in range(k):
        step = step_time_shape(draft, hw, decode_shape(batch, context_len + i), **kw)
        total += step.total_s - min(fixed, max(step.overhead_s, 0.0))
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
