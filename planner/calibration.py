"""Fit the step model's coefficients to measured step times (what `jaxserve calibrate` writes into a profile).

The additive step model is linear in the inverse efficiencies and the overheads:

    t = compute0 / compute_eff + (attn0 + attn_m_half * pass0) / (compute_eff * attn_eff_scale)
        + small0 / (compute_eff * attn_small_eff_scale) + gemm_small0 / (compute_eff * gemm_small_eff_scale)
        + head_small0 / (compute_eff * head_small_eff_scale)
        + weights0 / weight_bw_eff + gemv0 / (weight_bw_eff * gemv_speedup)
        + kv0 / kv_bw_eff + comm_bw0 / comm_eff + comm_latency
        + step_overhead + S * seq_overhead + prefill_rows * prefill_token_overhead

where `compute0` (GEMMs), `attn0` (attention FLOPs), `pass0` (one query row over each prefill chunk's KV),
`small0` (the attention FLOPs of chunks of at most SMALL_CHUNK_ROWS rows, at a rate of its own: a few rows
amortise the kernel's per-tile costs less; their passes stay in `pass0`, where the many
small chunks a calibration measures pin `attn_m_half` for all), `weights0` (matmuls of two rows or more),
`gemm_small0` (the FLOPs of GEMMs of at most SMALL_GEMM_ROWS rows, which jaxserve's CPU matmul kernel runs at
a rate flat in the rows; the other GEMMs' FLOPs, in `compute0`, ramp with gemm_m_half), `head_small0` (the LM
head's share of those: its kernel streams the embedding and adds little compute per row, so one rate for both
made the fit trade the projections against the head and under-predict loaded steps; see docs/tuning.md),
`gemv0` (one-row matmuls), `kv0`, `comm_bw0` are the model's terms at efficiency 1 (`unit_terms`), every one but
attention counted at the step's padded token count, and `prefill_rows` a step's prefill tokens plus its padding
(`step_model.prefill_rows`): the runtime computes padded rows like real ones, so pricing a step's per-token
cost on its real tokens under-predicted padded steps (docs/tuning.md has the measurement). Attention has
its own efficiency: on a CPU the jnp paged attention runs far below the GEMMs, and sharing one efficiency made
the fit trade long-context (chunked) steps against short prefills, over-predicting the latter. Its per-pass
term prices what a small chunk over a long history costs beyond its FLOPs (on a CPU such a chunk runs well below
a large block's FLOP rate; on a GPU each KV block is a few kernel launches; docs/tuning.md). A
non-negative least-squares fit on relative error (each row divided by its measured time) gives them; the GEMM
half-efficiency size `gemm_m_half` is chosen from a grid. Terms the samples cannot separate keep the prior. The
per-layer overhead folds into the per-step one (one model has one layer count), and `gemm_m_half` trades off
against the per-step overhead (a GEMM's time is linear in M with an intercept), so the pair is fitted for its
predictions, not as two separately meaningful numbers. So is `gemv_speedup` when it is not held: its column
holds one-decode steps only, so it also takes whatever else such a step costs apart (a one-token step has its
own attention and KV-write paths); the other steps pin the per-step overhead.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from modelspec.spec import ModelSpec
from planner.hardware import Coefficients, Hardware
from planner.step_model import (
    ATTENTION_PASS,
    ATTENTION_SMALL,
    EXPERTS,
    LM_HEAD,
    SMALL_GEMM_ROWS,
    StepShape,
    _collective_s,
    is_small_gemm,
    op_costs,
    prefill_rows,
    step_time_shape,
)

M_HALF_GRID = (0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
_COLUMNS = ("compute", "gemm_small", "head_small", "attn", "attn_pass", "attn_small", "weights", "gemv", "kv",
            "comm_bw", "step", "seq", "prefill_token")
_EFF_COLUMNS = ("compute", "gemm_small", "head_small", "attn", "attn_small", "weights", "kv", "comm_bw")
_ATTENTION_COLUMNS = {"attention": "attn", ATTENTION_PASS: "attn_pass", ATTENTION_SMALL: "attn_small"}
# Steps with small chunks (SMALL_CHUNK_ROWS) needed before their pairs get their own efficiency: with one or two,
# the free column would absorb those steps whole and loosen the GEMM terms they also pin.
MIN_SMALL_CHUNK_SAMPLES = 4
# Likewise steps with small GEMMs (SMALL_GEMM_ROWS) and steps with larger ones, before the two get rates apart.
MIN_SMALL_GEMM_SAMPLES = 4
GEMV_SPEEDUP_RANGE = (0.5, 3.0)  # what a fitted one-row rate may be, relative to the multi-row one


@dataclass(frozen=True)
class Sample:
    """One measured step: its batch shape and wall time in seconds."""

    shape: StepShape
    seconds: float
    padded_tokens: int = 0  # the token bucket the step ran at (0: its own token count)


def unit_terms(spec: ModelSpec, hw: Hardware, shape: StepShape, *, tp: int = 1, dtype: str = "bf16",
               kv_dtype: str | None = None, gemm_m_half: float = 16.0,
               small_gemms: bool = True, padded_tokens: int = 0) -> dict[str, float]:
    """The step model's terms at efficiency 1 (seconds), plus the fixed collective latency; the weights of
    one-row matmuls (`gemv`) apart from the others' (`weights`), since a CPU streams them through another
    kernel. With `small_gemms`, the FLOPs of small GEMMs (`is_small_gemm`) go to `gemm_small`, without the
    gemm_m_half ramp; without, they are GEMMs like the others."""
    peak = hw.peak(dtype)
    out = dict.fromkeys(_COLUMNS, 0.0)
    latency = 0.0
    moe = hw.coefficients  # the experts' own efficiencies are held (not fitted): their terms carry them
    for op in op_costs(spec, shape, tp=tp, dtype=dtype, kv_dtype=kv_dtype, padded_tokens=padded_tokens):
        n = op.count
        if op.name == EXPERTS:
            w = spec.moe_intermediate_size / tp
            width = w / (w + moe.moe_width_half)
            op = dataclasses.replace(op, flops=op.flops / (moe.moe_compute_eff_scale * width),
                                     weight_bytes=op.weight_bytes / (moe.moe_weight_bw_eff_scale * width),
                                     act_bytes=op.act_bytes / (moe.moe_weight_bw_eff_scale * width))
        if op.flops and small_gemms and is_small_gemm(op):
            out["head_small" if op.name == LM_HEAD else "gemm_small"] += op.flops * n / peak
        elif op.flops:
            g = op.gemm_rows / (op.gemm_rows + gemm_m_half) if op.gemm_rows else 1.0
            col = _ATTENTION_COLUMNS.get(op.name, "compute")
            out[col] += op.flops * n / (peak * g)
        out["gemv" if op.gemm_rows == 1 else "weights"] += (op.weight_bytes + op.act_bytes) * n / hw.memory_bw
        out["kv"] += op.kv_bytes * n / hw.memory_bw
        for _ in range(op.collectives):
            total = _collective_s(hw, tp, op.comm_bytes, op.allgather, 1.0)
            lat = _collective_s(hw, tp, op.comm_bytes, op.allgather, 1.0) - _collective_s(
                hw, tp, op.comm_bytes, op.allgather, 1.0, latency=False)
            out["comm_bw"] += (total - lat) * n
            latency += lat * n
    out["step"] = 1.0
    out["seq"] = float(shape.num_seqs)
    out["prefill_token"] = float(prefill_rows(shape, padded_tokens))
    out["comm_latency"] = latency
    return out


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a few columns: best of all column subsets."""
    n = a.shape[1]
    best, best_res = np.zeros(n), float(np.sum(y**2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = a[:, cols]
            x, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.all(x >= 0):
                res = float(np.sum((sub @ x - y) ** 2))
                if res < best_res - 1e-15:
                    best_res, best = res, np.zeros(n)
                    best[list(cols)] = x
    return best


def fit_coefficients(spec: ModelSpec, hw: Hardware, samples: Sequence[Sample], *, tp: int = 1,
                     dtype: str = "bf16", kv_dtype: str | None = None,
                     prior: Coefficients | None = None,
                     fixed: dict[str, float] | None = None) -> tuple[Coefficients, float]:
    """Coefficients that best explain `samples` (min relative squared error) and their median |rel. error|.

    `fixed` holds coefficients measured otherwise (e.g. `weight_bw_eff` from a weight-streaming benchmark: with
    one model the weight term is nearly constant across steps and cannot be told from the per-step overhead).
    Efficiencies in `fixed` are moved into the fixed part of the fit; `gemv_speedup`, unless held there, is
    fitted from the one-row steps (within GEMV_SPEEDUP_RANGE), the prior's where there are none.

    Use `hw.with_coefficients(**fitted.to_dict())` or `dataclasses.replace(hw, coefficients=fitted)` and
    `planner.hardware.save_profile` to write the profile.
    """
    if len(samples) < 3:
        raise ValueError("need at least 3 measured steps to fit")
    prior = prior or hw.coefficients
    fixed = dict(fixed or {})
    eff_of = {"compute": "compute_eff", "weights": "weight_bw_eff", "kv": "kv_bw_eff", "comm_bw": "comm_eff"}
    held_gemv = fixed.get("gemv_speedup")
    y = np.array([s.seconds for s in samples])
    jw, jg = _COLUMNS.index("weights"), _COLUMNS.index("gemv")
    best: tuple[float, Coefficients, float] | None = None
    # Small GEMMs get a rate of their own only when enough steps have some and enough have larger ones.
    ops = [op_costs(spec, s.shape, tp=tp, dtype=dtype, kv_dtype=kv_dtype, padded_tokens=s.padded_tokens)
           for s in samples]
    small_gemms = min(sum(any(is_small_gemm(op) for op in o) for o in ops),
                      sum(any(op.gemm_rows > SMALL_GEMM_ROWS for op in o) for o in ops)) >= MIN_SMALL_GEMM_SAMPLES
    # ... and the LM head's apart from the projections' only given steps whose head has fewer rows than their
    # small projections (decode-only steps have as many of each, which no fit can tell apart).
    small_head = small_gemms and sum(s.shape.num_seqs < s.shape.num_tokens <= SMALL_GEMM_ROWS
                                     for s in samples) >= MIN_SMALL_GEMM_SAMPLES
    for m_half in M_HALF_GRID:
        rows = [unit_terms(spec, hw, s.shape, tp=tp, dtype=dtype, kv_dtype=kv_dtype, gemm_m_half=m_half,
                           small_gemms=small_gemms, padded_tokens=s.padded_tokens) for s in samples]
        a = np.array([[r[c] for c in _COLUMNS] for r in rows])
        if not small_head:
            a[:, _COLUMNS.index("gemm_small")] += a[:, _COLUMNS.index("head_small")]
            a[:, _COLUMNS.index("head_small")] = 0.0
        lat = np.array([r["comm_latency"] for r in rows])
        js = _COLUMNS.index("attn_small")
        if np.count_nonzero(a[:, js]) < MIN_SMALL_CHUNK_SAMPLES:  # too few to price apart: as other chunks
            a[:, _COLUMNS.index("attn")] += a[:, js]
            a[:, js] = 0.0
        if held_gemv is not None:  # one-row weights are the multi-row ones', read held_gemv times faster
            a[:, jw] += a[:, jg] / held_gemv
            a[:, jg] = 0.0
        for j, col in enumerate(_COLUMNS):  # held coefficients: their term is known, not fitted
            if eff_of.get(col) in fixed:
                lat = lat + a[:, j] / fixed[eff_of[col]]
                a[:, j] = 0.0
        w = 1.0 / y  # relative error
        keep = [j for j in range(a.shape[1]) if np.any(a[:, j] > 0)]
        # Efficiencies are capped at 1.5, so their inverse terms are bounded below by 1/1.5: fit the excess.
        floor = np.array([1 / 1.5 if col in _EFF_COLUMNS and j in keep else 0.0 for j, col in enumerate(_COLUMNS)])
        if "weight_bw_eff" in fixed and jg in keep:  # likewise the GEMV's, capped at GEMV_SPEEDUP_RANGE's top
            floor[jg] = 1 / (fixed["weight_bw_eff"] * GEMV_SPEEDUP_RANGE[1])
        x = floor.copy()
        x[keep] += _nnls(a[:, keep] * w[:, None], (y - lat - a @ floor) * w)
        c = dict(zip(_COLUMNS, x, strict=True))
        present = {_COLUMNS[j] for j in keep}

        def inv(col: str, old: float, c: dict[str, float] = c, present: set[str] = present) -> float:
            """1 / fitted inverse efficiency (at most 1.5); the prior where no sample has the term."""
            return min(1.5, 1.0 / c[col]) if col in present else old

        compute_eff = inv("compute", prior.compute_eff)
        attn_eff = inv("attn", compute_eff * prior.attn_eff_scale)
        # A pass costs attn_m_half query rows at attention's rate: the ratio of the two fitted inverse rates.
        attn_m_half = c["attn_pass"] * attn_eff if "attn_pass" in present and "attn" in present else prior.attn_m_half
        small_scale = inv("attn_small", 0.0) / compute_eff if "attn_small" in present else prior.attn_small_eff_scale
        gemm_small_scale = (inv("gemm_small", 0.0) / compute_eff if "gemm_small" in present
                            else prior.gemm_small_eff_scale)
        head_small_scale = (inv("head_small", 0.0) / compute_eff if "head_small" in present
                            else prior.head_small_eff_scale)
        weight_bw_eff = fixed.get("weight_bw_eff", inv("weights", prior.weight_bw_eff))
        gemv_speedup = held_gemv if held_gemv is not None else prior.gemv_speedup
        if held_gemv is None and "gemv" in present:
            gemv_speedup = float(np.clip(1.0 / (c["gemv"] * weight_bw_eff), *GEMV_SPEEDUP_RANGE))
        fitted = dataclasses.replace(
            prior, compute_eff=compute_eff, gemm_m_half=m_half, attn_eff_scale=attn_eff / compute_eff,
            attn_m_half=attn_m_half, attn_small_eff_scale=small_scale, gemm_small_eff_scale=gemm_small_scale,
            head_small_eff_scale=head_small_scale,
            weight_bw_eff=weight_bw_eff, kv_bw_eff=inv("kv", prior.kv_bw_eff),
            comm_eff=inv("comm_bw", prior.comm_eff), step_overhead_s=c["step"], layer_overhead_s=0.0,
            seq_overhead_s=c["seq"], prefill_token_overhead_s=c["prefill_token"], gemv_speedup=gemv_speedup)
        fitted = dataclasses.replace(fitted, **{k: v for k, v in fixed.items() if k in eff_of.values()})
        fitted = Coefficients(**{k: float(v) for k, v in fitted.to_dict().items()})
        # Judge each m_half by what the written coefficients predict (efficiencies are capped at 1.5).
        fhw = dataclasses.replace(hw, coefficients=fitted)
        rel = np.array([step_time_shape(spec, fhw, s.shape, tp=tp, dtype=dtype, kv_dtype=kv_dtype,
                                        padded_tokens=s.padded_tokens).total_s for s in samples]) / y - 1
        err, sse = float(np.median(np.abs(rel))), float(np.sum(rel**2))
        if best is None or sse < best[0]:
            best = (sse, fitted, err)
    assert best is not None
    return best[1], best[2]
