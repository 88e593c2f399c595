"""The planner's Python API; `jaxserve plan` is a thin layer over `plan`.

Three first-class predictions the runtime's report calls on a (calibrated) hardware profile:
- `predict_step`: time of one engine step for a given ragged batch;
- `predict_serving`: TTFT/TPOT/ITL and throughput for a workload at a rate or concurrency, fixed config;
- `choose_chunk_size`: the prefill chunk that keeps running decodes' ITL under a target.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from modelspec.dtypes import dtype_bytes
from modelspec.memory import DoesNotFitError, MemoryPlan
from modelspec.spec import ModelSpec, load_model_spec
from planner.disaggregate import DisaggPlan, plan_disaggregated
from planner.fit_advice import check_context, longest_request, what_would_fit
from planner.hardware import Hardware, load_hardware, with_moe_kernels
from planner.search import Candidate, search
from planner.serving import ServingConfig, ServingPrediction, Workload
from planner.serving import predict_serving as _predict_serving
from planner.simulate import SimResult, simulate
from planner.speculative import SpeculativePrediction, choose_k, predict_speculative
from planner.step_model import (
    StepTime,
    decode_shape,
    pad_tokens,
    prefill_chunk_tokens,
    prefill_shape,
    step_time,
    step_time_shape,
)

DEFAULT_CONCURRENCY = 64


def resolve_model(model: str | Path | ModelSpec) -> ModelSpec:
    """A preset name, an HF config.json (or its folder), or a spec."""
    return model if isinstance(model, ModelSpec) else load_model_spec(str(model))


def predict_step(model: str | ModelSpec, hardware: str | Path | Hardware, decode_context_lens: Iterable[int] = (),
                 prefill_chunks: Iterable[tuple[int, int]] = (), *, tp: int = 1, dtype: str = "bf16",
                 kv_dtype: str | None = None, token_buckets: Sequence[int] = ()) -> StepTime:
    """Predicted time of one engine step (one TP group).

    decode_context_lens: tokens already in the KV cache of each decoding sequence (each adds one token).
    prefill_chunks: (chunk_len, already_computed_len) per prefill chunk in the same step.
    token_buckets: the runtime's padding ladder; the step's matmuls run at the bucket holding its tokens.
    Returns a `StepTime`: `.total_s`, the additive terms, `.roofline_s` and `.bottleneck`.
    """
    return step_time(resolve_model(model), load_hardware(hardware), decode_context_lens, prefill_chunks, tp=tp,
                     dtype=dtype, kv_dtype=kv_dtype, token_buckets=token_buckets)


def predict_serving(model: str | ModelSpec, hardware: str | Path | Hardware, workload: Workload,
                    config: ServingConfig | None = None, *, ttft_slo_ms: float | None = None,
                    tpot_slo_ms: float | None = None, memory: MemoryPlan | None = None) -> ServingPrediction:
    """Closed-form TTFT/TPOT/ITL (mean, p50, p90, p99 in ms), throughput and goodput for a fixed config.

    `workload` holds the lengths and either `request_rate` (Poisson, req/s) or `concurrency` (closed-loop
    clients), both totals over `config.replicas`. `memory`: the KV pool actually allocated (e.g. the
    runtime's, from `modelspec.memory.plan_memory` or its own page count) instead of a share of the device.
    """
    return _predict_serving(resolve_model(model), load_hardware(hardware), workload, config or ServingConfig(),
                            ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms, memory=memory)


@dataclass(frozen=True)
class ChunkChoice:
    """A prefill chunk size and the ITL it gives the decodes running beside a long prompt (ms)."""

    chunk_size: int
    max_itl_ms: float  # worst step while the prompt is prefilled in chunks (its last chunk)
    undisturbed_tpot_ms: float  # decode step without any prefill
    unchunked_itl_ms: float  # the stall if the whole prompt went in one step
    stall_itls_ms: tuple[float, ...]  # every step time during the chunked prefill
    num_chunks: int


def chunked_prefill_itls(model: str | ModelSpec, hardware: str | Path | Hardware, prompt_len: int, chunk_size: int,
                         *, decode_batch: int, context_len: int, tp: int = 1, dtype: str = "bf16",
                         kv_dtype: str | None = None, page_size: int = 1,
                         token_buckets: Sequence[int] = ()) -> list[float]:
    """Step times (s) the running decodes see while `prompt_len` is prefilled with a step budget `chunk_size`.

    The budget holds the decodes too; each chunk ends on a `page_size` boundary as the runtime cuts it
    (`page_size=1`: no alignment); `token_buckets` pads each step as the runtime does. The decodes start at
    `context_len` tokens and gain one per step (a 4k-token prompt in 4-token chunks takes 1024 steps, after which
    their attention costs as much again as at the start on a CPU).
    """
    spec, hw = resolve_model(model), load_hardware(hardware)
    budget = max(1, chunk_size - decode_batch)
    times, done = [], 0
    while done < prompt_len:
        q = prefill_chunk_tokens(done, prompt_len - done, budget, page_size)
        dec = decode_shape(decode_batch, context_len + len(times))
        shape = dec + prefill_shape(q, done) if decode_batch else prefill_shape(q, done)
        times.append(step_time_shape(spec, hw, shape, tp=tp, dtype=dtype, kv_dtype=kv_dtype,
                                     padded_tokens=pad_tokens(shape.num_tokens, token_buckets)).total_s)
        done += q
    return times


def choose_chunk_size(model: str | ModelSpec, hardware: str | Path | Hardware, itl_target_ms: float, *,
                      prompt_len: int, decode_batch: int, context_len: int, tp: int = 1, dtype: str = "bf16",
                      kv_dtype: str | None = None, page_size: int = 16, min_chunk: int = 1,
                      token_buckets: Sequence[int] = ()) -> ChunkChoice:
    """Largest step budget whose steps keep the ITL of `decode_batch` running decodes <= target.

    The chunk is the step's whole token budget (max_num_batched_tokens), decodes included, as the runtime
    schedules it: `decode_batch` + a whole number of pages of prefill. If even one page exceeds the target, a
    part of a page is tried: page_size / 2, / 4, ... down to `min_chunk` tokens (the runtime then fills a page in
    several steps); if even that exceeds the target, the smallest is returned (the best that can be done).
    """
    spec, hw = resolve_model(model), load_hardware(hardware)
    kw: dict[str, Any] = dict(decode_batch=decode_batch, context_len=context_len, tp=tp, dtype=dtype,
                              kv_dtype=kv_dtype, page_size=page_size, token_buckets=token_buckets)

    def worst(chunk: int) -> float:
        return max(chunked_prefill_itls(spec, hw, prompt_len, chunk, **kw))

    target = itl_target_ms / 1e3
    if worst(page_size + decode_batch) > target:
        parts = [page_size >> k for k in range(1, page_size.bit_length()) if page_size >> k >= max(1, min_chunk)]
        prefill = next((p for p in parts if worst(p + decode_batch) <= target), parts[-1] if parts else page_size)
        return _chunk_choice(spec, hw, prompt_len, prefill + decode_batch, kw)
    lo, hi = 1, math.ceil((prompt_len + decode_batch) / page_size)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if worst(mid * page_size + decode_batch) <= target:
            lo = mid
        else:
            hi = mid - 1
    return _chunk_choice(spec, hw, prompt_len, lo * page_size + decode_batch, kw)


def choose_num_scheduler_steps(model: str | ModelSpec, hardware: str | Path | Hardware, *, decode_batch: int = 1,
                               context_len: int = 512, tp: int = 1, dtype: str = "bf16",
                               kv_dtype: str | None = None, max_steps: int = 8, share: float = 0.05) -> int:
    """Fewest decode steps per dispatch at which the host's dispatch overhead (`dispatch_overhead_s`) is at most
    `share` of a decode step of `decode_batch` sequences, up to `max_steps`; 1 when it costs nothing. More steps
    only delay new arrivals' prefills and waste draws past a stop, so the smallest that hides the host wins."""
    spec, hw = resolve_model(model), load_hardware(hardware)
    dispatch = hw.coefficients.dispatch_overhead_s
    if dispatch <= 0:
        return 1
    one = step_time_shape(spec, hw, decode_shape(decode_batch, context_len), tp=tp, dtype=dtype,
                          kv_dtype=kv_dtype).total_s
    # dispatch / k <= share x (one - dispatch + dispatch / k), the step with k steps a dispatch
    device = max(one - dispatch, 1e-12)
    return int(min(max_steps, max(1, math.ceil(dispatch * (1 - share) / (share * device)))))


def _chunk_choice(spec: ModelSpec, hw: Hardware, prompt_len: int, chunk: int, kw: dict[str, Any]) -> ChunkChoice:
    """The step times of budget `chunk` beside the decodes of `kw` (`chunked_prefill_itls`'s arguments), and
    their undisturbed and unchunked ones."""
    b = max(kw["decode_batch"], 1)
    stalls = chunked_prefill_itls(spec, hw, prompt_len, chunk, **kw)
    undisturbed = step_time_shape(spec, hw, decode_shape(b, kw["context_len"]), tp=kw["tp"], dtype=kw["dtype"],
                                  kv_dtype=kw["kv_dtype"], padded_tokens=pad_tokens(b, kw["token_buckets"])).total_s
    unchunked = max(chunked_prefill_itls(spec, hw, prompt_len, prompt_len + kw["decode_batch"], **kw))
    return ChunkChoice(chunk_size=chunk, max_itl_ms=max(stalls) * 1e3, undisturbed_tpot_ms=undisturbed * 1e3,
                       unchunked_itl_ms=unchunked * 1e3, stall_itls_ms=tuple(t * 1e3 for t in stalls),
                       num_chunks=len(stalls))


@dataclass(frozen=True)
class PlanRequest:
    """Everything `jaxserve plan` takes. None means: search it (knobs) or not given (SLOs, load)."""

    model: str | ModelSpec = "llama-3.1-8b"
    hardware: str | Hardware = "h100-sxm"
    num_devices: int = 1
    input_len: int = 1024
    output_len: int = 256
    spread: float = 0.0
    prefix_hit: float = 0.0
    request_rate: float | None = None
    concurrency: float | None = None  # default DEFAULT_CONCURRENCY when neither rate nor concurrency given
    burstiness: float = 1.0  # gamma shape of the gaps between sends (vLLM's --burstiness)
    num_prompts: int | None = None  # the benchmark run's length: its first wave counts (None: steady state)
    scheduler: str = "mixed"  # how steps mix prefill and decode (planner.workload.SCHEDULERS)
    moe_kernels: str = "tuned"  # the MoE layers' kernels (planner.hardware.MOE_KERNELS)
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    tp: int | None = None
    max_num_seqs: int | None = None
    chunk_size: int | None = None
    page_size: int = 16
    dtype: str = "bf16"
    kv_dtype: str | None = None
    gpu_memory_utilization: float = 0.9
    num_scheduler_steps: int = 1  # decode steps per dispatch (the runtime's --num-scheduler-steps)
    async_scheduling: bool = False  # the overlapped loop (the runtime's --async-scheduling; a GPU's default)
    disaggregate: bool = False
    simulate: bool = False
    simulate_requests: int = 600
    # Speculative decoding: k drafts per step accepted with probability `acceptance` (planner/speculative.py).
    speculative_k: int | None = None
    acceptance: float | None = None
    speculative_method: str = "draft_model"
    draft_model: str | ModelSpec | None = None

    def workload(self) -> Workload:
        conc = self.concurrency
        if conc is None and self.request_rate is None:
            conc = DEFAULT_CONCURRENCY
        return Workload(input_len=self.input_len, output_len=self.output_len, spread=self.spread,
                        prefix_hit=self.prefix_hit, request_rate=self.request_rate, concurrency=conc,
                        burstiness=self.burstiness, num_prompts=self.num_prompts)


@dataclass
class PlanResult:
    """The chosen configuration, its predictions, the ranked candidates and optional extras."""

    request: PlanRequest
    spec: ModelSpec
    hardware: Hardware
    best: Candidate
    candidates: list[Candidate]
    disaggregated: DisaggPlan | None = None
    simulation: SimResult | None = None
    speculative: SpeculativePrediction | None = None  # at the plan's decode batch and mean context
    speculative_best: SpeculativePrediction | None = None  # the k (1..8) with the lowest TPOT at that acceptance
    notes: list[str] = field(default_factory=list)

    @property
    def config(self) -> ServingConfig:
        return self.best.config

    @property
    def prediction(self) -> ServingPrediction:
        return self.best.prediction

    def disaggregated_comparison(self) -> str:
        """What the disaggregated plan is compared with, and by what, in one sentence."""
        d, r = self.disaggregated, self.request
        if d is None:
            return ""
        slos = [f"{name} {v:g} ms" for name, v in (("TTFT", r.ttft_slo_ms), ("TPOT", r.tpot_slo_ms)) if v]
        meets = (f"requests/s meeting {' and '.join(slos)}" if slos
                 else "requests/s; no SLOs given, so every request counts")
        return (f"the best prefill/decode split, using {d.num_devices} of the {r.num_devices} devices, against the "
                f"colocated plan on all {r.num_devices}, by goodput per device used ({meets}, divided by the devices "
                f"each uses)")

    def to_json(self) -> dict[str, Any]:
        """One JSON-able object with the keys `jaxserve plan --json` promises (inf -> null)."""
        c, p = self.config, self.prediction
        mem = p.memory
        colocated = self.best.score[0] if p.stable else 0.0
        d = self.disaggregated
        out: dict[str, Any] = {
            "model": self.spec.name, "hardware": self.hardware.name, "num_devices": self.request.num_devices,
            "config": {"tp": c.tp, "replicas": c.replicas, "max_num_seqs": c.max_num_seqs,
                       "chunk_size": c.chunk_size, "page_size": c.page_size, "dtype": c.dtype,
                       "kv_dtype": c.kv_dtype or c.dtype, "num_scheduler_steps": c.num_scheduler_steps,
                       "async_scheduling": c.async_scheduling,
                       "scheduler": c.scheduler, "moe_kernels": self.request.moe_kernels},
            "workload": {"input_len": self.request.input_len, "output_len": self.request.output_len,
                         "spread": self.request.spread, "prefix_hit": self.request.prefix_hit,
                         "request_rate": self.request.request_rate,
                         "concurrency": self.request.workload().concurrency,
                         "burstiness": self.request.burstiness, "num_prompts": self.request.num_prompts},
            "predicted": {
                "ttft_ms": p.ttft.to_dict(), "tpot_ms": p.tpot.to_dict(), "itl_ms": p.itl.to_dict(),
                "output_tokens_per_s": p.output_tokens_per_s, "requests_per_s": p.requests_per_s,
                "goodput_requests_per_s": p.goodput_requests_per_s,
                "kv_capacity_tokens": mem.kv_capacity_tokens * c.replicas,
                "max_concurrency": p.max_concurrency * c.replicas,
                "memory_gib": mem.gib(),
                "step_ms": {"decode": p.decode_step.total_ms, "prefill_chunk": p.prefill_chunk_step.total_ms},
                "bottleneck": p.bottleneck,
                "stable": p.stable, "load": p.load, "capacity_requests_per_s": p.capacity_requests_per_s,
                "decode_batch": p.decode_batch, "decode_step_terms_ms": {k: v * 1e3 for k, v in
                                                                        p.decode_step.terms.items()},
                "roofline_decode_step_ms": p.decode_step.roofline_s * 1e3,
            },
            "disaggregated": None if d is None else {
                "prefill": {"instances": d.prefill_instances, "tp": d.prefill_tp},
                "decode": {"instances": d.decode_instances, "tp": d.decode_tp},
                "pd_ratio": d.pd_ratio, "kv_transfer_ms": d.kv_transfer_ms,
                "goodput_per_device": d.goodput_per_device, "colocated_goodput_per_device": colocated,
                "ttft_ms": d.ttft.to_dict(), "tpot_ms": d.tpot.to_dict(), "num_devices": d.num_devices,
                "compared": self.disaggregated_comparison()},
            "candidates": [cand.summary() for cand in self.candidates],
            "simulated": None if self.simulation is None else {
                "ttft_ms": self.simulation.ttft.to_dict(), "tpot_ms": self.simulation.tpot.to_dict(),
                "itl_ms": self.simulation.itl.to_dict(), "requests_per_s": self.simulation.requests_per_s,
                "output_tokens_per_s": self.simulation.output_tokens_per_s},
            "speculative": None if self.speculative is None else {
                **self.speculative.to_json(), "best_k": self.speculative_best.k,
                "best_tpot_ms": self.speculative_best.tpot_s * 1e3},
            "notes": self.notes,
        }
        return _finite(out)


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def plan(req: PlanRequest) -> PlanResult:
    """Search configurations for `req` and predict the best one (see `PlanRequest`).

    Raises ModelSpecError / HardwareError (unknown inputs), ConfigError (bad TP), DoesNotFitError, ValueError.
    """
    spec = resolve_model(req.model)
    hw = with_moe_kernels(load_hardware(req.hardware), req.moe_kernels)
    dtype_bytes(req.dtype)
    if req.kv_dtype:
        dtype_bytes(req.kv_dtype)
    if req.num_devices < 1:
        raise ValueError("--num-devices must be positive")
    check_context(spec, req.input_len, req.output_len, req.spread)
    wl = req.workload()
    tokens = longest_request(req.input_len, req.output_len, req.spread)
    try:
        cands = _search(req, spec, hw, wl)
        mem = cands[0].prediction.memory
        if mem.max_concurrency(tokens) < 1:
            raise DoesNotFitError(f"one request of {tokens} tokens does not fit the KV cache of {spec.name} on "
                                  f"{req.num_devices} x {hw.name} ({mem.kv_capacity_tokens:,} tokens)")
    except DoesNotFitError as e:
        ways = what_would_fit(spec, hw, req.num_devices, req.dtype, req.kv_dtype, tokens, req.gpu_memory_utilization)
        advice = f"; would fit: {'; or '.join(ways)}" if ways else ""
        raise DoesNotFitError(f"{str(e).splitlines()[0]}{advice}") from None
    best = cands[0]
    result = PlanResult(request=req, spec=spec, hardware=hw, best=best, candidates=cands)
    if not best.prediction.stable:
        result.notes.append("no configuration sustains the offered load; showing the least overloaded")
    if req.disaggregate:
        if req.num_devices < 2:
            result.notes.append("--disaggregate needs at least 2 devices")
        else:
            result.disaggregated = plan_disaggregated(
                spec, hw, wl, req.num_devices, dtype=req.dtype, kv_dtype=req.kv_dtype, page_size=req.page_size,
                gpu_memory_utilization=req.gpu_memory_utilization, ttft_slo_ms=req.ttft_slo_ms,
                tpot_slo_ms=req.tpot_slo_ms)
            if result.disaggregated is None:
                result.notes.append("no prefill/decode split fits and sustains the load on these devices")
    if req.simulate:
        result.simulation = simulate(spec, hw, wl, best.config, num_requests=req.simulate_requests)
    if req.speculative_k is not None:
        _plan_speculative(req, spec, hw, result)
    return result


def _plan_speculative(req: PlanRequest, spec: ModelSpec, hw: Hardware, result: PlanResult) -> None:
    """The speculative prediction at the chosen config's decode batch and the workload's mean context."""
    if req.acceptance is None:
        raise ValueError("--speculative-k needs --acceptance (the probability a draft token is accepted)")
    draft = resolve_model(req.draft_model) if req.draft_model is not None else None
    if req.speculative_method == "draft_model" and draft is None:
        raise ValueError("a draft_model plan needs --draft-model (or --speculative-method ngram)")
    kw: dict[str, Any] = dict(acceptance=req.acceptance, method=req.speculative_method, draft=draft,
                              batch=max(1, round(result.prediction.decode_batch)), tp=result.config.tp,
                              context_len=req.input_len + req.output_len / 2, dtype=req.dtype, kv_dtype=req.kv_dtype)
    result.speculative = predict_speculative(spec, hw, k=req.speculative_k, **kw)
    result.speculative_best = choose_k(spec, hw, **kw)


def with_coefficients(hardware: str | Path | Hardware, **coefficients: float) -> Hardware:
    """A hardware profile with some step-model coefficients replaced (e.g. fitted by calibration)."""
    hw = load_hardware(hardware)
    return replace(hw, coefficients=replace(hw.coefficients, **coefficients))


def _search(req: PlanRequest, spec: ModelSpec, hw: Hardware, wl: Workload) -> list[Candidate]:
    """The ranked candidates of `req` (`search`)."""
    return search(spec, hw, wl, req.num_devices, tp=req.tp, max_num_seqs=req.max_num_seqs,
                  chunk_size=req.chunk_size, page_size=req.page_size, dtype=req.dtype, kv_dtype=req.kv_dtype,
                  gpu_memory_utilization=req.gpu_memory_utilization, ttft_slo_ms=req.ttft_slo_ms,
                  tpot_slo_ms=req.tpot_slo_ms, num_scheduler_steps=req.num_scheduler_steps,
                  scheduler=req.scheduler, async_scheduling=req.async_scheduling)
