"""The platform policy: every choice that depends on the device, made once at start-up and passed down.

`choose_policy` looks at the engine's devices, its config and its model once, and fixes:

- the model's ops (`ModelOps`): the attention backend (`attention_choice.select_backend`) and the matmul route
  (on a CPU, jaxserve's C++ kernels at the row counts `kernel_choice` measured faster, and XLA's CPU tweaks);
- the sampler's cut: how top-k/top-p/min-p find their threshold ("sort" on accelerators; "search", a bitwise
  search over order keys, on a CPU, whose sort of a vocabulary's logits is slow; docs/tuning.md);
- XLA compiler options for the widest token buckets (a CPU's separate dots above 2048 tokens; docs/tuning.md);
- the overlapped loop's widest overlapped step (a CPU's host work shares the cores a wide step uses);
- whether the engine overlaps the host with the device by default (`--async-scheduling` unset): on an accelerator,
  yes (its steps hold no host round trip, so the host can run ahead); on a CPU, no (host and XLA share the cores);
- on a GPU, the tiles of the attention kernel's prefill items, timed once per device kind and head layout
  (`gpu_attention_choice`);
- whether a run of k decode steps a dispatch (`--num-scheduler-steps`) ends once every sequence has stopped: on a
  CPU, yes (the loop's condition is read where it runs, and a request's last run often needs fewer than k steps);
  on an accelerator, no (a data-dependent loop condition goes to the host every iteration);
- the smallest token bucket: on a GPU a step of fewer than 8 rows pads to 8, since XLA lowered one-row projections
  to reduce fusions at well below the bandwidth eight rows reach (docs/results.md, the GPU run of 2026-12-04).

Nothing on the step path looks at the platform again: the loops, the runner, the sampler and the model read the
policy's fields. `platform` is kept for logs, /version and the measurement tools.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.kernels.gpu.ragged_paged_attention import PallasAttention
from jaxserve.kernels.gpu.split_kv_decode import SplitKvAttention
from jaxserve.kernels.kv_quant import kv_kind
from jaxserve.model.attention.sharded import ShardedAttention
from jaxserve.model.ops import XLA_MATMULS, MatmulRoute, ModelOps
from jaxserve.platform import gpu_attention_choice, gpu_matmul_choice, kernel_choice
from jaxserve.platform.attention_choice import GPU_PLATFORMS, select_backend
from jaxserve.platform.devices import DeviceFacts, device_facts

log = logging.getLogger("jaxserve")

# Token buckets above this compile, on a CPU, with every dot a YNNPACK call of its own: from ~4096 rows XLA's CPU
# backend fuses each RMSNorm into the next projection's YNNPACK dot, which then runs well below its unfused speed.
# Below, the default fusions stay, since separate dots slow decode steps. See docs/tuning.md.
CPU_SEPARATE_DOTS_ABOVE = 2048
CPU_SEPARATE_DOTS_OPTIONS = (("xla_cpu_experimental_ynn_fusion_type", "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"),)
# On a CPU the host shares cores with XLA: host work beside a wide step (whose matmuls run on every core) slows it
# more than the overlap saves, so wider CPU steps run alone, as in the synchronous loop; see docs/tuning.md.
CPU_OVERLAP_MAX_TOKENS = 8
# On a GPU, steps pad to at least this many rows: one-row projections ran as reduce fusions (docs/attention.md).
GPU_MIN_TOKEN_BUCKET = 8


@dataclass(frozen=True)
class PlatformPolicy:
    """The device-dependent choices of one engine (see the module doc)."""

    platform: str  # "cpu", "gpu", "tpu": what the choices were made for
    ops: ModelOps
    decode_ops: ModelOps | None = None  # a step of decodes only runs these, when given (split-KV without prefill)
    sampler_cut: str = "sort"  # "sort" or "search"
    wide_step_above: int | None = None  # token buckets above this compile with `wide_step_options`
    wide_step_options: tuple[tuple[str, str], ...] = ()
    overlap_max_tokens: int | None = None  # the overlapped loop runs wider steps alone; None: overlaps all
    async_by_default: bool = False  # the loop when `--async-scheduling` is not given
    min_token_bucket: int = 1  # steps pad to at least this many tokens
    decode_run_exits_early: bool = False  # a k-step decode run stops once every sequence has stopped
    # a disaggregated measurement runs each pool as a server pinned to its own cores (one process's pools on a CPU
    # would share its cores and XLA's threads)
    pools_as_pinned_processes: bool = False
    facts: DeviceFacts | None = None  # the devices as start-up read them (the measurement tools' kind, memory)

    def compiler_options(self, num_tokens: int) -> dict[str, str] | None:
        """XLA compiler options of the forward for a `num_tokens` bucket (None: the defaults)."""
        if self.wide_step_above is not None and num_tokens > self.wide_step_above:
            return dict(self.wide_step_options)
        return None

    def overlaps(self, num_tokens: int) -> bool:
        """Whether the overlapped loop runs host work beside a step of `num_tokens` tokens."""
        return self.overlap_max_tokens is None or num_tokens <= self.overlap_max_tokens

    def ops_for(self, decode_only: bool) -> ModelOps:
        """The ops a step runs: `decode_ops` for a step of decodes only (when the policy has them), else `ops`."""
        return self.decode_ops if decode_only and self.decode_ops is not None else self.ops

    def token_buckets(self, ladder: Sequence[int]) -> tuple[int, ...]:
        """The engine's token buckets on this platform: `ladder`'s rungs, none below `min_token_bucket`."""
        return tuple(sorted({max(b, self.min_token_bucket) for b in ladder}))

    def describe(self) -> str:
        """One line for the start-up log."""
        plan = self.ops.matmul.plan
        matmul = plan.describe() if plan is not None else (
            "C++ matmuls wherever they fit" if self.ops.matmul.cpu_kernel else "XLA's dots")
        loop = "overlapped (async scheduling)" if self.async_by_default else "synchronous"
        pad = f"; steps pad to >= {self.min_token_bucket} tokens" if self.min_token_bucket > 1 else ""
        return (f"platform {self.platform}: attention {self.ops.attention.name} ({self.ops.attention}); {matmul}; "
                f"sampler cut by {self.sampler_cut}; default loop {loop}{pad}")


def default_dtype(platform: str) -> jnp.dtype:
    """What `--dtype auto` means on `platform`: float32 on a CPU (XLA's bf16 there is slow), bfloat16 elsewhere."""
    return jnp.dtype(jnp.float32 if platform == "cpu" else jnp.bfloat16)


def default_dtype_of(devices: Sequence[jax.Device]) -> jnp.dtype:
    """What `--dtype auto` means on `devices` (read at start-up, before the model is built)."""
    return default_dtype(device_facts(devices).platform)


def default_platform() -> str:
    """This process's default platform, for callers that run the model without an engine (tests, scripts)."""
    return jax.default_backend()


def choose_policy(model: Any, kv_caches: Any, *, attention_backend: str = "auto", cpu_kernels: bool = True,
                  token_buckets: Sequence[int] = (), seq_buckets: Sequence[int] = (),
                  kernel_plan: Any = None, overlapped: bool = False) -> PlatformPolicy:
    """The policy for `model` with its KV pool `kv_caches` (whose sharding names the devices).

    `attention_backend` (`--attention-backend`) and `cpu_kernels` (`--cpu-kernels`) are the engine's flags; the
    buckets are the row counts the kernel plan measures (on a CPU, once per machine, cached); `kernel_plan` forces
    one (tests, or a draft model sharing its target's). `overlapped`: the engine runs the overlapped loop, whose
    host work shares a CPU's cores with the steps it overlaps, so the plan times those steps' row counts with a
    stand-in for that work beside them. Raises ValueError for an attention backend that cannot run here."""
    sharding = kv_caches[0][0].sharding
    devices = sharding.device_set
    facts = device_facts(devices)
    platform = facts.platform
    cpu = facts.cpu
    one_device = len(devices) == 1
    kernels = cpu_kernels and one_device  # XLA cannot split the CPU kernels' custom calls over a mesh
    k0 = kv_caches[0][0]
    num_sms = getattr(next(iter(devices)), "core_count", None) if not cpu else None
    attention = select_backend(attention_backend, platform, k0.dtype, k0.shape[3], k0.shape[1],
                               cpu_kernels=kernels, num_devices=len(devices), kv_cache_dtype=kv_kind(k0),
                               num_sms=num_sms)
    route = None
    if cpu and kernels:
        beside = sorted(r for r in {*token_buckets, *seq_buckets} if r <= CPU_OVERLAP_MAX_TOKENS) if overlapped else ()
        plan = kernel_plan or kernel_choice.choose(model, token_buckets, seq_buckets, beside_host=beside)
        route = dataclasses.replace(kernel_choice.CPU_KERNEL_ROUTE, plan=plan) if plan is not None else None
    mesh = None if one_device else getattr(sharding, "mesh", None)
    if platform in GPU_PLATFORMS:
        device = next(iter(devices))
        if isinstance(attention, SplitKvAttention) and one_device and token_buckets:
            attention = _tuned_prefill(attention, model, k0, max(token_buckets), device)
        route = MatmulRoute(matvec_rows=gpu_matmul_choice.choose(model, token_buckets, device) if one_device
                            else frozenset(), fp8_activations=gpu_matmul_choice.fp8_tensor_cores(device))
    return dataclasses.replace(policy_for(platform, attention, route, mesh), facts=facts)


def _tuned_prefill(attention: SplitKvAttention, model: Any, k0: Any, num_tokens: int,
                   device: Any) -> SplitKvAttention:
    """`attention` with the prefill tiles measured fastest for the widest step (`gpu_attention_choice`)."""
    heads = getattr(getattr(model.layers[0], "attn", None), "num_heads", None)
    if heads is None:  # a model without GQA heads to time (the kernel runs only GQA pools)
        return attention
    return gpu_attention_choice.choose(attention, num_tokens=num_tokens, num_heads=heads, num_kv_heads=k0.shape[2],
                                       head_dim=k0.shape[3], page_size=k0.shape[1], dtype=k0.dtype, device=device)


def policy_for(platform: str, attention: Any, route: MatmulRoute | None = None, mesh: Any = None) -> PlatformPolicy:
    """The policy of `platform` once its attention backend and its matmul route (what was measured on this machine:
    a CPU's kernel plan, a GPU's few-row matmul rows; None for XLA's own dots) are chosen: every other choice
    follows from the platform alone. On a `mesh` of several devices a Pallas kernel runs under `shard_map` (each
    device its own heads)."""
    decode = dataclasses.replace(attention, decode_only=True) if isinstance(attention, SplitKvAttention) else None
    if mesh is not None and isinstance(attention, PallasAttention | SplitKvAttention):
        attention = ShardedAttention(attention, mesh)
        decode = ShardedAttention(decode, mesh) if decode is not None else None
    if platform == "cpu":
        route = route or kernel_choice.CPU_XLA_ROUTE
        return PlatformPolicy(platform, ModelOps(attention, route), ModelOps(decode, route) if decode else None,
                              sampler_cut="search", wide_step_above=CPU_SEPARATE_DOTS_ABOVE,
                              wide_step_options=CPU_SEPARATE_DOTS_OPTIONS, overlap_max_tokens=CPU_OVERLAP_MAX_TOKENS,
                              decode_run_exits_early=True, pools_as_pinned_processes=True)
    gpu = platform in GPU_PLATFORMS
    route = route or XLA_MATMULS
    return PlatformPolicy(platform, ModelOps(attention, route),
                          ModelOps(decode, route) if decode else None, sampler_cut="sort",
                          async_by_default=True, min_token_bucket=GPU_MIN_TOKEN_BUCKET if gpu else 1)


def default_ops(kv_caches: Any, *, cpu_kernels: bool = True) -> ModelOps:
    """The ops `choose_policy` picks for a pool on this process's default device, without measuring a kernel plan
    (every row count the kernels take): for tests and scripts that run the model without an engine."""
    k0 = kv_caches[0][0]
    platform = default_platform()
    attention = select_backend("auto", platform, k0.dtype, k0.shape[3], k0.shape[1], cpu_kernels=cpu_kernels,
                               kv_cache_dtype=kv_kind(k0))
    if platform != "cpu":
        return ModelOps(attention, XLA_MATMULS)
    return ModelOps(attention, kernel_choice.CPU_KERNEL_ROUTE if cpu_kernels else kernel_choice.CPU_XLA_ROUTE)
