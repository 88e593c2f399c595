"""Engine configuration: one dataclass, built once from `LLM(...)` keyword arguments or CLI flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxserve.config.speculative import SpeculativeConfig, parse_speculative_config

# What `--dtype` accepts for weights and activations; "auto" is the platform policy's (`policy.default_dtype`).
ARRAY_DTYPES = ("float32", "bfloat16", "float16")
RUNTIME_DTYPES = ("auto", *ARRAY_DTYPES)
# `--quantization`: the weight formats jaxserve/model/quantize.py can run.
QUANTIZATIONS = ("int8", "fp8")
# `--attention-backend`: auto picks at start-up (jaxserve/platform/attention_choice.py); the others force one.
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "pallas", "pallas-split")
# `--kv-cache-dtype` (vLLM's names): auto stores KV in `dtype`; int8 and fp8 (e4m3) store codes with one float32
# scale per token per KV head (kernels/kv_quant.py). fp8_e4m3 is vLLM's other name for fp8.
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")


@dataclass
class EngineConfig:
    """Everything that shapes an engine; names follow `vllm serve` flags where they exist.

    `kv_cache_memory` is the KV budget in bytes per device; when None, `gpu_memory_utilization` of an
    accelerator's memory is used, or a default budget on CPU. `max_model_len` defaults to the model's
    maximum positions capped by what the pool can hold.
    """

    model: str = "tiny"
    # vLLM's --tokenizer: a folder holding tokenizer.json, in place of the model's own (None: the model's).
    tokenizer: str | None = None
    # vLLM's --chat-template: the Jinja template's text, in place of the tokenizer's (None: the tokenizer's).
    chat_template: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunk_size: int = 512
    page_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    # The host schedules step k+1 while step k runs (engine/loops/overlapped.py); single-process colocated engines
    # only. None: the platform policy's default for the device (resolved when the engine starts).
    async_scheduling: bool | None = None
    # Decode steps per dispatch when every running request decodes (vLLM's --num-scheduler-steps).
    num_scheduler_steps: int = 1
    # vLLM's --speculative-config (a JSON string or dict on the way in, a SpeculativeConfig after __post_init__).
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # On a CPU in float32, attention and the matmuls of steps of up to 32 tokens run in jaxserve's C++ kernels
    # (kernels/cpu/library.py), built on first use; off, or where no compiler works, they stay in XLA.
    cpu_kernels: bool = True
    # Paged attention's implementation; the engine replaces "auto" by what it resolved to at start-up.
    attention_backend: str = "auto"
    # vLLM's --quantization: None keeps `dtype` (or what a pre-quantized checkpoint holds, which the engine writes
    # here); "int8"/"fp8" store every projection weight as 8-bit codes with per-output-channel scales
    # (model/quantize.py).
    quantization: str | None = None
    # vLLM's --kv-cache-dtype (KV_CACHE_DTYPES); "fp8_e4m3" is stored as "fp8".
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    device_ids: tuple[int, ...] = field(default_factory=tuple)  # indices into jax.devices(); empty: the first tp
    # Disaggregated serving: a prefill pool on the first `prefill_devices` devices, a decode pool on the next
    # `decode_devices`; each pool is one engine whose TP degree is its device count.
    disaggregate: bool = False
    prefill_devices: int = 1
    decode_devices: int = 1
    max_pending_transfers: int = 8  # prefilled requests waiting for the decode pool before prefill pauses
    # Multi-host (jax.distributed): one engine process per host; process 0 schedules, the others follow.
    coordinator_address: str | None = None  # HOST:PORT of process 0's coordinator
    num_processes: int = 1
    process_id: int = 0
    served_model_name: str | None = None
    token_buckets: tuple[int, ...] = field(default_factory=tuple)  # empty: derived from the budgets
    seq_buckets: tuple[int, ...] = field(default_factory=tuple)
    compilation_cache_dir: str | None = "~/.cache/jaxserve/xla"
    warmup: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "page_size", "tensor_parallel_size",
                     "prefill_devices", "decode_devices", "max_pending_transfers", "num_processes",
                     "num_scheduler_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.chunk_size % self.page_size and self.chunk_size > self.page_size:
            raise ValueError(f"chunk_size ({self.chunk_size}) must be a multiple of page_size ({self.page_size})")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self.device_ids = tuple(int(i) for i in self.device_ids)
        if self.device_ids and len(self.device_ids) != self.tensor_parallel_size:
            raise ValueError(f"device_ids {self.device_ids} must name tensor_parallel_size "
                             f"({self.tensor_parallel_size}) devices")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("num_processes > 1 needs coordinator_address (HOST:PORT of process 0)")
        if self.num_processes > 1 and self.disaggregate:
            raise ValueError("disaggregated serving runs in one process; it cannot be combined with num_processes > 1")
        if self.async_scheduling and (self.disaggregate or self.num_processes > 1):
            raise ValueError("async_scheduling needs a colocated engine in one process "
                             "(not with disaggregate or num_processes > 1)")
        if self.num_scheduler_steps > 1 and (self.async_scheduling or self.disaggregate or self.num_processes > 1):
            raise ValueError("num_scheduler_steps > 1 needs the synchronous loop of a colocated engine in one process "
                             "(not with async_scheduling, disaggregate or num_processes > 1)")
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.speculative_config and (self.async_scheduling or self.num_scheduler_steps > 1 or self.disaggregate
                                        or self.num_processes > 1):
            raise ValueError("speculative_config runs the synchronous one-step loop of a colocated engine in one "
                             "process (not with async_scheduling, num_scheduler_steps > 1, disaggregate or "
                             "num_processes > 1)")
        if self.token_buckets and max(self.token_buckets) < self.max_num_batched_tokens:
            raise ValueError(f"the largest token bucket ({max(self.token_buckets)}) must hold a whole step "
                             f"(max_num_batched_tokens={self.max_num_batched_tokens})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization is not None and (self.tensor_parallel_size > 1 or self.disaggregate):
            raise ValueError("quantization runs on one device (not with tensor_parallel_size > 1 or disaggregate)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        self.kv_cache_dtype = "fp8" if self.kv_cache_dtype == "fp8_e4m3" else self.kv_cache_dtype
        if self.kv_cache_dtype != "auto" and (self.disaggregate or self.num_processes > 1):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} runs in one process's engine (not with "
                             "disaggregate, whose transfers move float pages, or num_processes > 1)")
        if self.scheduling_policy not in ("fcfs", "lpm"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'lpm', got {self.scheduling_policy!r}")

    @property
    def supports_async_scheduling(self) -> bool:
        """Whether this configuration can run the overlapped loop (see the checks in `__post_init__`)."""
        return not (self.disaggregate or self.num_processes > 1 or self.num_scheduler_steps > 1
                    or self.speculative_config)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
