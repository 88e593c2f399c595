"""Fit the planner's step-model coefficients to measured step times (pure numpy + planner; no jax).

The planner's step time is additive (planner.step_model.time_ops):

    t = F_c(m_half) / compute_eff + F_w / weight_bw_eff + F_kv / kv_bw_eff
        + step_overhead + num_seqs * seq_overhead + prefill_tokens * prefill_token_overhead

where F_c sums FLOPs / (peak * M / (M + m_half)) over GEMMs (plain FLOPs / peak elsewhere), F_w is weight +
activation bytes / bandwidth and F_kv KV bytes / bandwidth, all from the planner's own `op_costs`. For each
m_half on a grid we solve the linear problem for the inverse efficiencies and overheads by non-negative least
squares on relative error (rows scaled by 1/t), efficiencies kept within the profile's (0, 1.5]; the m_half
with the smallest error wins. The per-layer overhead cannot be told apart from the per-step one with one model,
so the constant is reported as step overhead and layer_overhead is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.hardware import Coefficients, Hardware
from planner.model_spec import ModelSpec
from planner.step_model import StepShape, op_costs

M_HALF_GRID = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
MAX_EFF = 1.5  # the profile loader's upper bound on an efficiency
MIN_EFF = 0.005
FEATURES = ("inv_compute_eff", "inv_weight_bw_eff", "inv_kv_bw_eff", "step_overhead_s", "seq_overhead_s",
            "prefill_token_overhead_s")


@dataclass
class StepSample:
    """One measured engine step: its shape and its wall time (s)."""

    shape: StepShape
    seconds: float
    kind: str = "step"  # decode | prefill | mixed (for the report)


@dataclass
class FitResult:
    """Fitted coefficients and how well they explain the samples."""

    coefficients: Coefficients
    median_abs_error: float
    max_abs_error: float
    errors: list[float] = field(default_factory=list)  # relative error per sample (predicted / measured - 1)


def features(spec: ModelSpec, hw: Hardware, shape: StepShape, m_half: float, *, dtype: str) -> np.ndarray:
    """The six regressors of one step (see the module docstring)."""
    peak, bw = hw.peak(dtype), hw.memory_bw
    fc = fw = fkv = 0.0
    for op in op_costs(spec, shape, dtype=dtype):
        n = op.count
        if op.flops:
            frac = op.gemm_rows / (op.gemm_rows + m_half) if op.gemm_rows else 1.0
            fc += op.flops * n / (peak * frac)
        fw += (op.weight_bytes + op.act_bytes) * n / bw
        fkv += op.kv_bytes * n / bw
    return np.array([fc, fw, fkv, 1.0, float(shape.num_seqs), float(shape.prefill_tokens)])


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """Non-negative least squares min ||a x - b||, x >= 0 (Lawson-Hanson active set)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iters):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12 * max(1.0, np.abs(w).max()):
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
            if not passive.any():
                break
    return x


def _solve(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Coefficients with inverse efficiencies >= 1/MAX_EFF (shifted) and overheads >= 0, relative rows."""
    lower = np.array([1 / MAX_EFF, 1 / MAX_EFF, 1 / MAX_EFF, 0, 0, 0])
    scale = 1.0 / t
    a = x * scale[:, None]
    b = (t - x @ lower) * scale
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    coef = nnls(a / norms, b) / norms + lower
    coef[:3] = np.minimum(coef[:3], 1 / MIN_EFF)
    return coef


def fit_coefficients(spec: ModelSpec, hw: Hardware, samples: Sequence[StepSample], *, dtype: str,
                     m_half_grid: Sequence[float] = M_HALF_GRID) -> FitResult:
    """Best coefficients for `samples` on `hw` (its peak and bandwidth normalise the regressors)."""
    if len(samples) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} step samples to fit, got {len(samples)}")
    t = np.array([s.seconds for s in samples])
    best: tuple[float, float, np.ndarray] | None = None
    for mh in m_half_grid:
        x = np.stack([features(spec, hw, s.shape, mh, dtype=dtype) for s in samples])
        coef = _solve(x, t)
        err = float(np.sqrt(np.mean(((x @ coef) / t - 1) ** 2)))
        if best is None or err < best[0]:
            best = (err, mh, coef)
    assert best is not None
    _, mh, coef = best
    c = Coefficients(compute_eff=1 / coef[0], gemm_m_half=mh, weight_bw_eff=1 / coef[1], kv_bw_eff=1 / coef[2],
                     comm_eff=hw.coefficients.comm_eff, step_overhead_s=coef[3], layer_overhead_s=0.0,
                     seq_overhead_s=coef[4], prefill_token_overhead_s=coef[5])
    x = np.stack([features(spec, hw, s.shape, mh, dtype=dtype) for s in samples])
    errors = ((x @ coef) / t - 1).tolist()
    abs_err = np.abs(errors)
    return FitResult(coefficients=c, median_abs_error=float(np.median(abs_err)), max_abs_error=float(abs_err.max()),
                     errors=errors)
