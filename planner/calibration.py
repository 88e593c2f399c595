"""Fit the step model's coefficients to measured step times (what `jaxserve calibrate` writes into a profile).

The additive step model is linear in the inverse efficiencies and the overheads:

    t = compute0 / compute_eff + weights0 / weight_bw_eff + kv0 / kv_bw_eff + comm_bw0 / comm_eff + comm_latency
        + step_overhead + S * seq_overhead + prefill_tokens * prefill_token_overhead

where `compute0`, `weights0`, `kv0`, `comm_bw0` are the model's terms at efficiency 1 (`unit_terms`). A
non-negative least-squares fit on relative error (each row divided by its measured time) gives them; the
GEMM half-efficiency size `gemm_m_half` is chosen from a grid. Terms the samples cannot separate keep the
prior. The per-layer overhead folds into the per-step one (one model has one layer count), and
`gemm_m_half` trades off against the per-step overhead (a GEMM's time is linear in M with an intercept), so
the pair is fitted for its predictions, not as two separately meaningful numbers.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.hardware import Coefficients, Hardware
from planner.model_spec import ModelSpec
from planner.step_model import StepShape, _collective_s, op_costs

M_HALF_GRID = (0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
_COLUMNS = ("compute", "weights", "kv", "comm_bw", "step", "seq", "prefill_token")


@dataclass(frozen=True)
class Sample:
    """One measured step: its batch shape and wall time in seconds."""

    shape: StepShape
    seconds: float


def unit_terms(spec: ModelSpec, hw: Hardware, shape: StepShape, *, tp: int = 1, dtype: str = "bf16",
               kv_dtype: str | None = None, gemm_m_half: float = 16.0) -> dict[str, float]:
    """The step model's terms at efficiency 1 (seconds), plus the fixed collective latency."""
    peak = hw.peak(dtype)
    out = dict.fromkeys(_COLUMNS, 0.0)
    latency = 0.0
    for op in op_costs(spec, shape, tp=tp, dtype=dtype, kv_dtype=kv_dtype):
        n = op.count
        if op.flops:
            g = op.gemm_rows / (op.gemm_rows + gemm_m_half) if op.gemm_rows else 1.0
            out["compute"] += op.flops * n / (peak * g)
        out["weights"] += (op.weight_bytes + op.act_bytes) * n / hw.memory_bw
        out["kv"] += op.kv_bytes * n / hw.memory_bw
        for _ in range(op.collectives):
            total = _collective_s(hw, tp, op.comm_bytes, op.allgather, 1.0)
            lat = _collective_s(hw, tp, op.comm_bytes, op.allgather, 1.0) - _collective_s(
                hw, tp, op.comm_bytes, op.allgather, 1.0, latency=False)
            out["comm_bw"] += (total - lat) * n
            latency += lat * n
    out["step"] = 1.0
    out["seq"] = float(shape.num_seqs)
    out["prefill_token"] = float(shape.prefill_tokens)
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

    `fixed` holds coefficients measured otherwise (e.g. `weight_bw_eff` from a weight-streaming benchmark:
    with one model the weight term is nearly constant across steps and cannot be told from the per-step
    overhead). Efficiencies in `fixed` are moved into the fixed part of the fit.

    Use `hw.with_coefficients(**fitted.to_dict())` or `dataclasses.replace(hw, coefficients=fitted)` and
    `planner.hardware.save_profile` to write the profile.
    """
    if len(samples) < 3:
        raise ValueError("need at least 3 measured steps to fit")
    prior = prior or hw.coefficients
    fixed = dict(fixed or {})
    eff_of = {"compute": "compute_eff", "weights": "weight_bw_eff", "kv": "kv_bw_eff", "comm_bw": "comm_eff"}
    y = np.array([s.seconds for s in samples])
    best: tuple[float, Coefficients, float] | None = None
    for m_half in M_HALF_GRID:
        rows = [unit_terms(spec, hw, s.shape, tp=tp, dtype=dtype, kv_dtype=kv_dtype, gemm_m_half=m_half)
                for s in samples]
        a = np.array([[r[c] for c in _COLUMNS] for r in rows])
        lat = np.array([r["comm_latency"] for r in rows])
        for j, col in enumerate(_COLUMNS):  # held coefficients: their term is known, not fitted
            if eff_of.get(col) in fixed:
                lat = lat + a[:, j] / fixed[eff_of[col]]
                a[:, j] = 0.0
        w = 1.0 / y  # relative error
        keep = [j for j in range(a.shape[1]) if np.any(a[:, j] > 0)]
        x = np.zeros(a.shape[1])
        x[keep] = _nnls(a[:, keep] * w[:, None], (y - lat) * w)
        pred = a @ x + lat
        err = float(np.median(np.abs(pred / y - 1)))
        sse = float(np.sum((pred / y - 1) ** 2))
        c = dict(zip(_COLUMNS, x, strict=True))

        def inv(v: float, old: float) -> float:
            return min(1.5, 1.0 / v) if v > 1e-12 else old

        fitted = dataclasses.replace(
            prior, compute_eff=inv(c["compute"], prior.compute_eff), gemm_m_half=m_half,
            weight_bw_eff=inv(c["weights"], prior.weight_bw_eff), kv_bw_eff=inv(c["kv"], prior.kv_bw_eff),
            comm_eff=inv(c["comm_bw"], prior.comm_eff), step_overhead_s=c["step"], layer_overhead_s=0.0,
            seq_overhead_s=c["seq"], prefill_token_overhead_s=c["prefill_token"])
        fitted = dataclasses.replace(fitted, **{k: v for k, v in fixed.items() if k in eff_of.values()})
        if best is None or sse < best[0]:
            best = (sse, fitted, err)
    assert best is not None
    return best[1], best[2]
