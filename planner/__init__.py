"""The jaxserve planner: roofline + queueing capacity model. Pure Python and numpy; never imports JAX.

Entry points (see planner.api): `plan(PlanRequest) -> PlanResult`, `predict_step`, `predict_serving`,
`choose_chunk_size`; the memory formula the runtime sizes its KV pool with is `planner.memory.kv_pool_pages`.
"""

from planner.api import (
    ChunkChoice,
    PlanRequest,
    PlanResult,
    choose_chunk_size,
    chunked_prefill_itls,
    plan,
    predict_serving,
    predict_step,
    with_coefficients,
)
from planner.hardware import CATALOG, Coefficients, Hardware, load_hardware
from planner.serving import ServingConfig, ServingPrediction, Workload

__all__ = [
    "CATALOG", "ChunkChoice", "Coefficients", "Hardware", "PlanRequest", "PlanResult", "ServingConfig",
    "ServingPrediction", "Workload", "choose_chunk_size", "chunked_prefill_itls", "load_hardware", "plan",
    "predict_serving", "predict_step", "with_coefficients",
]
