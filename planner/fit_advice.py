"""What `jaxserve plan` says when a request cannot be planned: a workload past the model's context, or a model
that fits no configuration, with what would fit instead (8-bit or 4-bit weights, more devices, a shorter context)."""

from __future__ import annotations

import math

from modelspec.memory import DoesNotFitError, plan_memory
from modelspec.spec import ModelSpec
from planner.hardware import Hardware
from planner.search import tp_options

SMALLER_WEIGHTS = ("fp8", "int4")  # tried in turn when the weights' dtype is wider
MAX_DEVICES = 512  # the largest device count suggested


def longest_request(input_len: int, output_len: int, spread: float) -> int:
    """Tokens of the longest request of a workload whose lengths are uniform in [L(1-s), L(1+s)]."""
    return math.ceil(input_len * (1 + spread)) + math.ceil(output_len * (1 + spread))


def check_context(spec: ModelSpec, input_len: int, output_len: int, spread: float = 0.0) -> None:
    """ValueError, in one line, when the workload's longest request exceeds the model's context."""
    longest = longest_request(input_len, output_len, spread)
    if longest > spec.max_position_embeddings:
        extra = f" (up to {longest} with --spread {spread:g})" if spread else ""
        raise ValueError(f"--input-len {input_len} + --output-len {output_len}{extra} exceed {spec.name}'s context of "
                         f"{spec.max_position_embeddings} tokens; shorten them")


def fits(spec: ModelSpec, hw: Hardware, num_devices: int, dtype: str, kv_dtype: str | None, tokens: int,
         gpu_memory_utilization: float) -> bool:
    """Whether some TP degree on `num_devices` holds the weights, a small step's workspace and one request of
    `tokens` in KV."""
    for tp in tp_options(spec, num_devices):
        try:
            mem = plan_memory(spec, hw.memory_bytes, tp=tp, dtype=dtype, kv_dtype=kv_dtype, chunk_size=512,
                              max_num_seqs=1, gpu_memory_utilization=gpu_memory_utilization)
        except DoesNotFitError:
            continue
        if mem.max_concurrency(tokens) >= 1:
            return True
    return False


def what_would_fit(spec: ModelSpec, hw: Hardware, num_devices: int, dtype: str, kv_dtype: str | None, tokens: int,
                   gpu_memory_utilization: float) -> list[str]:
    """Changes that make the plan fit, each a phrase: smaller weights, more devices, a shorter context."""
    out = []
    for small in SMALLER_WEIGHTS:
        if dtype not in SMALLER_WEIGHTS[SMALLER_WEIGHTS.index(small):] and fits(
                spec, hw, num_devices, small, kv_dtype, tokens, gpu_memory_utilization):
            flag = f"--quantization {small}" if small == "fp8" else f"--dtype {small}"
            out.append(f"{small} weights ({flag}) on {_devices(num_devices)}")
            break
    n = num_devices * 2
    while n <= MAX_DEVICES and not fits(spec, hw, n, dtype, kv_dtype, tokens, gpu_memory_utilization):
        n *= 2
    if n <= MAX_DEVICES:
        out.append(f"{n} x {hw.name} in {dtype} (--num-devices {n})")
    short = _longest_fitting(spec, hw, num_devices, dtype, kv_dtype, tokens, gpu_memory_utilization)
    if short:
        out.append(f"requests of at most {short} tokens (input + output) on {_devices(num_devices)}")
    return out


def _longest_fitting(spec: ModelSpec, hw: Hardware, num_devices: int, dtype: str, kv_dtype: str | None, tokens: int,
                     gpu_memory_utilization: float) -> int:
    """The longest request (tokens, a power of two below `tokens`) that fits, or 0."""
    t = 2 ** (max(tokens - 1, 1).bit_length() - 1)
    while t >= 16:
        if fits(spec, hw, num_devices, dtype, kv_dtype, t, gpu_memory_utilization):
            return t
        t //= 2
    return 0


def _devices(n: int) -> str:
    return "this device" if n == 1 else f"these {n} devices"
