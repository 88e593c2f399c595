"""The jaxserve planner: roofline + queueing capacity model. Pure Python and numpy; never imports JAX.

Entry points (see planner.api): `plan(PlanRequest) -> PlanResult`, `predict_step`, `predict_serving`,
`choose_chunk_size`, `choose_num_scheduler_steps`, `predict_speculative` / `choose_k` (speculative decoding),
`fit_coefficients` (calibration), `pool_balance`
(disaggregated pools); the memory formula the runtime sizes its KV pool with is `modelspec.memory.kv_pool_pages`.
"""

from planner.api import (
    ChunkChoice,
    PlanRequest,
    PlanResult,
    choose_chunk_size,
    choose_num_scheduler_steps,
    chunked_prefill_itls,
    plan,
    predict_serving,
    predict_step,
    with_coefficients,
)
from planner.calibration import Sample, fit_coefficients, unit_terms
from planner.disaggregate import PoolBalance, pool_balance
from planner.hardware import CATALOG, Coefficients, Hardware, load_hardware, save_profile
from planner.serving import ServingConfig, ServingPrediction, Workload
from planner.speculative import SpeculativePrediction, choose_k, expected_tokens_per_step, predict_speculative

__all__ = [
    "CATALOG", "ChunkChoice", "Coefficients", "Hardware", "PlanRequest", "PlanResult", "PoolBalance", "Sample",
    "ServingConfig", "ServingPrediction", "SpeculativePrediction", "Workload", "choose_k", "expected_tokens_per_step",
    "predict_speculative", "choose_chunk_size", "choose_num_scheduler_steps",
    "chunked_prefill_itls",
    "fit_coefficients", "load_hardware", "plan", "pool_balance", "predict_serving", "predict_step", "save_profile",
    "unit_terms", "with_coefficients",
]
