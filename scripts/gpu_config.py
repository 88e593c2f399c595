"""The report configuration of the prepared GPU scripts (`gpu_report.sh`, `gpu_chunked.sh`): `synthetic-1b` in bf16.

Five token buckets, not fourteen: each costs a GPU compile, and padding a small step is nearly free on a GPU
(ridge point ~300 FLOP/byte); prefill steps pay for their padding (the planner does not model it).
"""

from __future__ import annotations

import dataclasses

from jaxserve.measure.calibrate.calibrate import CalibrationConfig
from jaxserve.measure.report.context import ReportConfig
from planner.api import resolve_model


def report_config(model: str = "synthetic-1b", dtype: str = "bfloat16", kv_gib: float = 24) -> ReportConfig:
    """What both GPU scripts run: grid 1/16/64 x 512/2048, two loads, a 4096-token prompt beside 8 decodes (half
    the model's context when that is under 8k tokens, as for `tiny` in the scripts' CPU self-check)."""
    max_len = resolve_model(model).max_position_embeddings
    return ReportConfig(
        model=model, dtype=dtype, max_num_seqs=64, batch_sizes=(1, 16, 64), context_lens=(512, 2048),
        grid_output_len=32, load_input_len=512, load_output_len=128, load_num_prompts=200,
        long_prompt_len=4096 if max_len >= 8192 else max_len // 2,
        long_decodes=8, long_decode_input=256, long_tail_tokens=32, kv_cache_memory=int(kv_gib * 2**30),
        token_buckets=(32, 128, 512, 2048, 4160),
        calibration=CalibrationConfig(
            prefill_lens=(64, 256, 1024, 2048, 4096), decode_batches=(1, 8, 32, 64), decode_contexts=(256, 2048),
            decode_steps=8, max_decode_prompt_tokens=2**17, mixed_decodes=8, mixed_prompt_len=2048, mixed_chunk=512,
            gemm_rows=(1, 16, 64, 256, 1024, 4096), bandwidth_bytes=2**30, matmul_n=8192, repeats=3))


def budget_report_config(model: str = "synthetic-1b", dtype: str = "bfloat16", quantization: str | None = None,
                         smoke: bool = False) -> ReportConfig:
    """The calibrate + report run that fits the GPU check's budget (`scripts/gpu_parts/report.py`): about 40 s
    a run on one H200, two runs (bf16, fp8) in the check; `smoke`: `tiny`'s quick report on a CPU."""
    if smoke:
        calibration = dataclasses.replace(CalibrationConfig.quick(), prefill_lens=(16, 32), decode_contexts=(16,),
                                          mixed_small_chunks=(16,), gemm_rows=(1, 16), dispatch_tokens=5)
        return dataclasses.replace(ReportConfig.quick_config("tiny"), dtype=dtype, quantization=quantization,
                                   load_fractions=(0.5,), token_buckets=(4, 16, 64, 192), calibration=calibration)
    return ReportConfig(
        model=model, dtype=dtype, quantization=quantization, max_num_seqs=16, batch_sizes=(1, 16),
        context_lens=(512,), grid_output_len=32, load_input_len=256, load_output_len=32, load_num_prompts=48,
        load_fractions=(0.5,), long_prompt_len=2048, long_decodes=4, long_decode_input=256, long_tail_tokens=16,
        kv_cache_memory=4 * 2**30, token_buckets=(32, 128, 512, 2112),
        calibration=CalibrationConfig(
            prefill_lens=(64, 512, 2048), decode_batches=(1, 16), decode_contexts=(256, 1024), decode_steps=8,
            decode_rounds=1, max_decode_prompt_tokens=2**15, mixed_decodes=4, mixed_prompt_len=1024, mixed_chunk=256,
            mixed_small_prompt_len=512, mixed_small_samples=2, dispatch_tokens=17, dispatch_rounds=1,
            gemm_rows=(1, 64, 1024), bandwidth_bytes=2**28, matmul_n=4096, repeats=2))
