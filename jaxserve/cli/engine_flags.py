"""Engine flags shared by every command that builds an engine (`serve`, `generate`, `bench`, `report`).

Names follow `vllm serve`; they map one-to-one onto `EngineConfig` fields.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import click

from jaxserve.config.engine import ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATIONS, RUNTIME_DTYPES, EngineConfig
from modelspec.spec import load_model_spec

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '2GB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 1073741824, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class _Bytes(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param, ctx) -> int:
        return value if isinstance(value, int) else parse_bytes(str(value))


# The trained model that ships with jaxserve (jaxserve/trained_models/bard): the default of the commands a person runs
# first (serve, generate, eval); tests and benchmarks keep the synthetic `tiny` (EngineConfig.model).
SERVING_DEFAULT_MODEL = "bard"


def _model_option(default: str) -> Callable:
    return click.option("--model", default=default, show_default=True,
                        help="Preset name (bard, tiny, small, ...) or HF checkpoint folder.")


_OPTIONS = [
    _model_option(EngineConfig.model),
    click.option("--dtype", default="auto", show_default=True,
                 type=click.Choice(RUNTIME_DTYPES),
                 help="auto: float32 on CPU, bfloat16 on GPU/TPU."),
    click.option("--seed", default=0, show_default=True, type=int),
    click.option("--max-num-seqs", default=EngineConfig.max_num_seqs, show_default=True,
                 type=click.IntRange(min=1)),
    click.option("--max-num-batched-tokens", default=EngineConfig.max_num_batched_tokens, show_default=True,
                 type=click.IntRange(min=1), help="Token budget of one step."),
    click.option("--chunk-size", default=EngineConfig.chunk_size, show_default=True,
                 type=click.IntRange(min=1), help="Largest prefill chunk of one request per step."),
    click.option("--block-size", "page_size", default=EngineConfig.page_size, show_default=True,
                 type=click.IntRange(min=1), help="Tokens per KV page."),
    click.option("--kv-cache-memory", "--kv-cache-memory-bytes", "kv_cache_memory", type=_Bytes(), default=None,
                 help="KV pool bytes per device (e.g. 512MiB; vLLM's --kv-cache-memory-bytes); default: a fraction "
                      "of GPU memory, 1 GiB on CPU."),
    click.option("--gpu-memory-utilization", default=0.9, show_default=True, type=click.FloatRange(0, 1)),
    click.option("--max-model-len", type=click.IntRange(min=1), default=None),
    click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True),
    click.option("--scheduling-policy", type=click.Choice(["fcfs", "lpm"]), default="fcfs", show_default=True),
    click.option("--async-scheduling/--no-async-scheduling", default=None,
                 help="Schedule step k+1 while step k runs on the device (host work overlaps the device). Default: "
                      "the device's (on an accelerator, on; on a CPU, off)."),
    click.option("--num-scheduler-steps", default=EngineConfig.num_scheduler_steps, show_default=True,
                 type=click.IntRange(min=1),
                 help="Decode steps per dispatch while every running request decodes (stops checked on the device)."),
    click.option("--speculative-config", default=None, metavar="JSON",
                 help='Speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
                      '"prompt_lookup_max": 4, "prompt_lookup_min": 1}\' or \'{"method": "draft_model", '
                      '"model": "tiny", "num_speculative_tokens": 4}\'.'),
    click.option("--cpu-kernels/--no-cpu-kernels", default=True, show_default=True,
                 help="On a CPU, float32: attention and the matmuls of up to 32 rows run in jaxserve's compiled C++ "
                      "kernels (off: XLA's own)."),
    click.option("--attention-backend", default=EngineConfig.attention_backend, show_default=True,
                 type=click.Choice(ATTENTION_BACKENDS),
                 help="Paged attention: auto (the C++ kernel on a CPU, the Pallas kernel on an NVIDIA GPU, where "
                      "they can run), reference (jnp), cpu, or pallas (on a CPU: interpreted, tests only)."),
    click.option("--quantization", default=None, type=click.Choice(QUANTIZATIONS),
                 help="Weight quantization at load: int8 or fp8 (e4m3) stores every projection and the LM head as "
                      "8-bit codes with per-output-channel float32 scales (the embedding stays in --dtype); default: "
                      "none, or what a pre-quantized (compressed-tensors) checkpoint holds."),
    click.option("--kv-cache-dtype", default=EngineConfig.kv_cache_dtype, show_default=True,
                 type=click.Choice(KV_CACHE_DTYPES),
                 help="KV pages: auto (in --dtype), or int8 / fp8 (e4m3; fp8_e4m3 is the same) codes with one float32 "
                      "scale per token per KV head, about half bf16's bytes a token."),
    click.option("--tensor-parallel-size", "-tp", default=1, show_default=True, type=click.IntRange(min=1),
                 help="Devices the model is sharded over (mesh axis tp); the first N devices."),
    click.option("--disaggregate/--no-disaggregate", default=False, show_default=True,
                 help="Prefill and decode on separate device groups, KV moved between them."),
    click.option("--prefill-devices", default=1, show_default=True, type=click.IntRange(min=1),
                 help="With --disaggregate: devices (and TP degree) of the prefill pool, the first ones."),
    click.option("--decode-devices", default=1, show_default=True, type=click.IntRange(min=1),
                 help="With --disaggregate: devices (and TP degree) of the decode pool, after the prefill ones."),
    click.option("--max-pending-transfers", default=EngineConfig.max_pending_transfers, show_default=True,
                 type=click.IntRange(min=1),
                 help="With --disaggregate: prefilled requests waiting for the decode pool before prefill pauses."),
    click.option("--compilation-cache-dir", default=EngineConfig.compilation_cache_dir, show_default=True,
                 metavar="DIR", callback=lambda ctx, param, value: None if value.lower() == "none" else value,
                 help="Where compiled XLA programs persist, so that a restart skips compiling them; 'none': compile "
                      "at every start. Processes may share one (each entry is written whole)."),
    click.option("--warmup/--no-warmup", default=EngineConfig.warmup, show_default=True,
                 help="Compile every token bucket and sampler variant at start, so no request waits for a compile; "
                      "--no-warmup starts sooner and compiles each shape when a step first needs it."),
    click.option("--coordinator-address", default=None, metavar="HOST:PORT",
                 help="Multi-host: process 0's jax.distributed coordinator; the mesh spans every process."),
    click.option("--num-processes", default=1, show_default=True, type=click.IntRange(min=1),
                 help="Multi-host: processes in the job (one per host)."),
    click.option("--process-id", default=0, show_default=True, type=click.IntRange(min=0),
                 help="Multi-host: this process's rank; 0 schedules and serves, the others follow."),
]


def engine_options(fn: Callable) -> Callable:
    """Decorate a click command with every engine flag."""
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


def serving_engine_options(fn: Callable) -> Callable:
    """`engine_options` with SERVING_DEFAULT_MODEL as the default --model (serve, generate, eval)."""
    for option in reversed([_model_option(SERVING_DEFAULT_MODEL), *_OPTIONS[1:]]):
        fn = option(fn)
    return fn


ENGINE_OPTION_NAMES = ("model", "dtype", "seed", "max_num_seqs", "max_num_batched_tokens", "chunk_size",
                       "page_size", "kv_cache_memory", "gpu_memory_utilization", "max_model_len",
                       "enable_prefix_caching", "scheduling_policy", "async_scheduling", "num_scheduler_steps",
                       "speculative_config", "cpu_kernels", "attention_backend", "quantization",
                       "kv_cache_dtype", "tensor_parallel_size", "disaggregate",
                       "prefill_devices", "decode_devices", "max_pending_transfers", "compilation_cache_dir", "warmup",
                       "coordinator_address", "num_processes", "process_id")


def config_from_options(options: dict[str, Any], **overrides: Any) -> EngineConfig:
    """Pop the engine flags out of a command's kwargs into an EngineConfig (bad values -> UsageError)."""
    fields = {name: options.pop(name) for name in ENGINE_OPTION_NAMES if name in options}
    try:
        config = EngineConfig(**fields, **overrides)
        load_model_spec(config.model)  # an unknown model is one line now, not after JAX loads
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return config


def build_engine(config: EngineConfig, *, announce: bool = True):
    """The engine the flags ask for (colocated, disaggregated or multi-host); a bad config is a UsageError."""
    from jaxserve.cli.log_setup import setup_logging

    setup_logging()
    logging.getLogger("jaxserve").info("loading JAX and building the engine for %s (a first start on this machine "
                                       "also builds kernels and compiles: a minute or two)", config.model)
    t0 = time.monotonic()
    from jaxserve.engine.factory import create_engine  # JAX loads here, not for --help

    try:
        engine = create_engine(config)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if announce:
        click.echo(f"engine ready in {time.monotonic() - t0:.1f} s", err=True)
    return engine
