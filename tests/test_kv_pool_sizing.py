"""The planner's KV pool is the runtime's: for the same flags, `plan_memory` and the engine's sizing give the same
pages, with --gpu-memory-utilization applied as vLLM applies it (a share of the device's total memory, less
the weights and the activation peak of a max_num_batched_tokens step)."""

import pytest

from jaxserve.config.engine import EngineConfig
from jaxserve.runner.model_builder import kv_budget_bytes, kv_dtype_name
from modelspec.memory import GIB, DoesNotFitError, kv_pool_pages, plan_memory
from modelspec.spec import PRESETS
from planner.hardware import CATALOG


class FakeAccelerator:
    """A device as JAX reports one with an allocator: `memory_stats()["bytes_limit"]` is the memory it may use."""

    platform = "gpu"

    def __init__(self, memory_bytes: float):
        self.memory_bytes = memory_bytes

    def memory_stats(self) -> dict[str, float]:
        return {"bytes_limit": self.memory_bytes, "bytes_in_use": 0}


def runtime_pages(config: EngineConfig, model: str, dtype_name: str, device: FakeAccelerator) -> int:
    spec = PRESETS[model]
    budget = kv_budget_bytes(config, spec, dtype_name, device)
    return kv_pool_pages(spec, budget, config.page_size, kv_dtype_name(config, dtype_name),
                         config.tensor_parallel_size)


@pytest.mark.parametrize(("model", "hardware", "dtype", "kv", "tp", "util", "tokens", "seqs", "page"), [
    ("llama-3.1-8b", "h100-sxm", "bf16", "auto", 1, 0.9, 8192, 256, 16),
    ("llama-3.1-70b", "h200", "bf16", "auto", 4, 0.92, 2048, 128, 16),
    ("llama-3.1-70b", "mi300x", "bf16", "int8", 2, 0.8, 16384, 512, 32),
    ("mixtral-8x7b", "h100-sxm", "bf16", "auto", 2, 0.9, 8192, 256, 16),
    ("qwen2.5-7b", "a100-40g", "bf16", "fp8", 8, 0.85, 4096, 64, 16),  # 4 KV heads replicated over 8 devices
    ("small", "cpu", "fp32", "auto", 1, 0.5, 512, 16, 16),
])
def test_a_plans_kv_pool_is_the_pool_the_runtime_allocates(model, hardware, dtype, kv, tp, util, tokens, seqs, page):
    hw = CATALOG[hardware]
    config = EngineConfig(model=model, dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype], kv_cache_dtype=kv,
                          tensor_parallel_size=tp, gpu_memory_utilization=util, max_num_batched_tokens=tokens,
                          max_num_seqs=seqs, page_size=page, chunk_size=min(512, tokens))
    plan = plan_memory(PRESETS[model], hw.memory_bytes, tp=tp, dtype=dtype, kv_dtype=None if kv == "auto" else kv,
                       page_size=page, chunk_size=tokens, max_num_seqs=seqs, gpu_memory_utilization=util)
    assert plan.num_pages == runtime_pages(config, model, dtype, FakeAccelerator(hw.memory_bytes))
    # ... and the page the runtime keeps for itself (its trash page, vLLM's null block) holds no sequence.
    assert plan.kv_capacity_tokens == (plan.num_pages - 1) * page


def test_vendor_gigabytes_are_binary_and_the_share_is_of_the_whole_device():
    # An "80 GB" H100 holds 80 GiB: the 8B model's pool at 0.9 is 0.9 x 80 GiB less weights and activations,
    # not 0.9 x 80e9 bytes (7% of the device, 10% of this pool, more).
    assert CATALOG["h100-sxm"].memory_bytes == 80 * GIB
    assert CATALOG["h200"].memory_bytes == 141 * GIB and CATALOG["mi300x"].memory_bytes == 192 * GIB
    spec = PRESETS["llama-3.1-8b"]
    plan = plan_memory(spec, 80 * GIB, chunk_size=8192, max_num_seqs=256)
    assert plan.weights + plan.activations + plan.kv == pytest.approx(0.9 * 80 * GIB, abs=plan.page_size *
                                                                     plan.kv_bytes_per_token)
    decimal = plan_memory(spec, 80e9, chunk_size=8192, max_num_seqs=256)
    assert plan.num_pages / decimal.num_pages == pytest.approx(1.10, abs=0.01)


def test_a_model_that_leaves_no_kv_budget_is_refused_by_both():
    with pytest.raises(DoesNotFitError):
        plan_memory(PRESETS["llama-3.1-70b"], 80 * GIB, tp=1, dtype="bf16")
    config = EngineConfig(model="llama-3.1-70b", dtype="bfloat16")
    with pytest.raises(ValueError, match="no memory for the KV cache"):
        kv_budget_bytes(config, PRESETS["llama-3.1-70b"], "bf16", FakeAccelerator(80 * GIB))
