"""The synchronous engine: schedule -> run one step -> sample -> check stops -> outputs.

`LLMEngine.step()` is the whole serving loop body; `LLM` drives it to completion for a batch of prompts and
`AsyncEngine` drives it from a background thread for streaming clients.

With `async_scheduling` the host runs one step ahead of the device (vLLM's async scheduling, SGLang's overlap
scheduler): each `step()` schedules and dispatches step k, whose decodes read step k-1's tokens on the device
through placeholders, and only then waits for step k-1 and turns its tokens into outputs. Scheduling, batch
layout and stop checks overlap the device instead of adding to every step. A request that stops at step k-1 has
computed one wasted token in step k, which is dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.core.batch import RaggedBatch, is_placeholder
from jaxserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepStats
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.stops import StopChecker
from jaxserve.core.tokenizer import load_tokenizer
from jaxserve.core.validation import encode_prompt, resolve_max_tokens
from jaxserve.runner.decode_run import DecodeRun, DecodeRunner, can_run_on_device
from jaxserve.runner.logits_processing import prepare_request
from jaxserve.runner.model_builder import build_model_and_cache
from jaxserve.runner.model_runner import ModelRunner, StepResult, default_token_ladder, power_of_two_ladder
from jaxserve.runner.prompt_logprobs import PromptLogprobs, PromptRows, plan_rows, record
from jaxserve.runner.sampler import SamplingArrays
from jaxserve.scheduler.kv_cache_manager import KVCacheManager
from jaxserve.scheduler.scheduler import Scheduler, SchedulerConfig
from jaxserve.spec_decode.step import SpeculativeDecoder, spec_k, spec_metrics
from jaxserve.structured.grammar import GRAMMAR_FAILED
from modelspec.spec import load_model_spec

log = logging.getLogger("jaxserve")

# On a CPU the host shares cores with XLA: host work beside a wide step (whose matmuls run on every core) slows it
# more than the overlap saves, so wider CPU steps run alone, as in the synchronous loop; see docs/tuning.md.
CPU_OVERLAP_MAX_TOKENS = 8


@dataclass
class _Flight:
    """A dispatched step not yet collected (asynchronous scheduling)."""

    batch: RaggedBatch
    sampling: SamplingArrays
    pending: Any
    placeholders: list[tuple[Request, int, int]] = field(default_factory=list)
    prompt_rows: tuple[PromptRows | None, dict[int, PromptLogprobs]] = (None, {})


@dataclass
class _Tracked:
    """Engine-side companions of a scheduler Request."""

    request: Request
    prompt: str | None
    seed: int
    stops: StopChecker
    logprobs: list[dict[int, float]] | None = field(default=None)
    prompt_logprobs: PromptLogprobs | None = None  # one entry per prompt token, filled as its rows run


class LLMEngine:
    """Owns the model runner, the KV cache manager and the scheduler; turns steps into outputs."""

    supports_prompt_logprobs = True

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.spec = load_model_spec(config.model)
        self.tokenizer = load_tokenizer(config.model, self.spec)
        built = build_model_and_cache(config, self.spec)
        self.max_model_len = built.max_model_len
        self.num_pages = built.num_pages
        self.dtype = built.dtype
        token_buckets = config.token_buckets or default_token_ladder(config.max_num_batched_tokens)
        seq_buckets = config.seq_buckets or power_of_two_ladder(config.max_num_seqs)
        self.runner = ModelRunner(built.model, built.kv_caches, page_size=config.page_size,
                                  max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
                                  token_buckets=token_buckets, seq_buckets=seq_buckets,
                                  cpu_kernels=config.cpu_kernels, attention_backend=config.attention_backend,
                                  max_logits_rows=config.max_num_seqs * (1 + spec_k(config)))
        config.attention_backend = self.runner.attention.name  # what "auto" resolved to, for /version
        log.info("attention backend: %s (%s), KV cache %s", self.runner.attention.name, self.runner.attention,
                 config.kv_cache_dtype)
        self.kv_manager = KVCacheManager(num_pages=self.num_pages, page_size=config.page_size,
                                         enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            chunk_size=config.chunk_size, page_size=config.page_size, max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching, policy=config.scheduling_policy),
            self.kv_manager)
        self._tracked: dict[str, _Tracked] = {}
        self._seed_rng = np.random.default_rng(config.seed)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "num_preemptions": 0,
                         "prefix_cache_queries": 0, "prefix_cache_hits": 0, "steps": 0}
        self.last_step: StepStats | None = None
        self._flight: _Flight | None = None
        self.decode_runner = (DecodeRunner(self.runner, config.num_scheduler_steps)
                              if config.num_scheduler_steps > 1 else None)
        self.spec_decoder = (SpeculativeDecoder(self, config.speculative_config, self.spec, self.num_pages)
                             if config.speculative_config else None)
        if config.warmup:
            self.runner.warmup()
            for extra in (self.decode_runner, self.spec_decoder):
                if extra is not None:
                    extra.warmup()

    # Submission ----------------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt given as text or ids (`validation.encode_prompt`)."""
        return encode_prompt(prompt, self.tokenizer, self.spec.vocab_size)

    def resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """Completion budget: params.max_tokens, or the rest of the context when None; checked to fit."""
        return resolve_max_tokens(prompt_len, params.max_tokens, self.max_model_len)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    prompt_token_ids: list[int] | None = None) -> Request:
        """Queue a request; raises ValueError (with a client-ready message) when it can never be served."""
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize_prompt(prompt)
        max_tokens = self.resolve_max_tokens(len(ids), params)
        if params.prompt_logprobs is not None and (not self.supports_prompt_logprobs or self.runner.step_hook):
            raise ValueError("prompt_logprobs is not supported by a disaggregated or multi-host engine")
        if self.spec_decoder is not None:
            self.spec_decoder.check(params)
        req = Request(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                      arrival_time=self.clock() if arrival_time is None else arrival_time,
                      eos_token_id=self._eos_token_id(), cache_salt=cache_salt, max_tokens=max_tokens)
        prepare_request(req, self.tokenizer, self.spec.vocab_size, multi_host=self.runner.step_hook is not None)
        self.scheduler.add_request(req)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**32))
        self._tracked[request_id] = _Tracked(
            request=req, prompt=prompt if isinstance(prompt, str) else None, seed=seed,
            stops=StopChecker(params, self.tokenizer, self.max_model_len),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] * len(ids) if params.prompt_logprobs is not None else None)
        self.counters["prompt_tokens"] += len(ids)
        return req

    def _eos_token_id(self) -> int | None:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        return self.spec.eos_token_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; returns its final output, or None if unknown."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.abort_request(request_id)
        req = tracked.request
        req.status = RequestStatus.FINISHED_ABORTED
        req.finish_time = self.clock()
        if req.output_token_ids and is_placeholder(req.output_token_ids[-1]):  # in flight: dropped
            req.output_token_ids.pop()
        return self._output(tracked)

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    # The loop body -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every request that drew a token or finished.

        With asynchronous scheduling the outputs are those of the step dispatched by the previous call.
        """
        if self.config.async_scheduling:
            return self._step_async()
        if self.spec_decoder is not None:  # speculative decoding: synchronous one-step dispatches
            return self.spec_decoder.step(self.clock())
        start = self.clock()
        if self.decode_runner is not None and can_run_on_device(self.scheduler.running):
            run = self.scheduler.schedule_decode_run(self.decode_runner.k)
            if run is not None:
                return self._step_decode_run(*run, start)
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        sampling = self._sampling_for(batch, self.runner)
        compiles = self.runner.compile_count()
        rows, lists = self._prompt_rows(batch)
        result = self.runner.collect(self.runner.dispatch(batch, sampling, prompt_rows=rows), batch, sampling)
        compiled = self.runner.compile_count() > compiles
        if rows is not None:
            record(rows, result.prompt_logprobs, batch, lists)
        sampled = np.where(batch.samples, result.tokens, -1)
        self.scheduler.update_after_step(batch, sampled)
        now = self.clock()
        outputs = []
        for s, req in enumerate(batch.requests):
            if not batch.samples[s]:
                continue
            tracked = self._tracked[req.request_id]
            try:
                outputs.append(self._postprocess(tracked, result, s, now))
            except Exception as e:  # one request's failure (e.g. detokenizing) must not stop the others
                log.exception("request %s failed", req.request_id)
                outputs.append(self._fail(tracked, f"internal error: {type(e).__name__}: {e}"))
        self._record_step(batch, start, compiled)
        return outputs

    def _step_decode_run(self, batch: RaggedBatch, limits: list[int], start: float) -> list[RequestOutput]:
        """Up to k decode steps in one dispatch; each sequence's tokens past its stop (or a stop string) dropped."""
        sampling = self._sampling_for(batch, self.runner)
        compiles = self.compile_count()
        run = DecodeRun.build(batch, limits, self.decode_runner.k, self.config.page_size)
        drawn, logprobs = self.decode_runner.execute(batch, sampling, run)
        compiled = self.compile_count() > compiles
        now = self.clock()
        outputs = []
        for s, req in enumerate(batch.requests):
            tracked = self._tracked[req.request_id]
            for j in range(limits[s]):
                self.scheduler.record_token(req, drawn[j, s])
                try:
                    out = self._postprocess(tracked, StepResult(drawn[j], logprobs[j], None, None), s, now)
                except Exception as e:  # one request's failure (e.g. detokenizing) must not stop the others
                    log.exception("request %s failed", req.request_id)
                    out = self._fail(tracked, f"internal error: {type(e).__name__}: {e}")
                if out.finished:
                    break
            outputs.append(out)
        self._record_step(batch, start, compiled)
        return outputs

    def compile_count(self) -> int:
        """Compiled variants of every step function so far (none after warm-up)."""
        extras = (self.decode_runner, self.spec_decoder)
        return self.runner.compile_count() + sum(x.compile_count() for x in extras if x is not None)

    def _step_async(self) -> list[RequestOutput]:
        """Dispatch step k (its decodes read step k-1's tokens on the device), then collect step k-1.

        A wide step on a CPU runs without overlap: step k-1 is collected first and step k at once.
        """
        start = self.clock()
        batch = self.scheduler.schedule()
        prev, outputs, self._flight = self._flight, [], None
        if batch is None:
            return self._collect_flight(prev) if prev is not None else []
        sampling = self._sampling_for(batch, self.runner)  # before any collect finishes a request of `batch`
        overlap = self.runner.platform != "cpu" or batch.num_tokens <= CPU_OVERLAP_MAX_TOKENS
        # Logits processing (penalties, bans) reads each row's newest token: the step waits for the one before.
        overlap = overlap and not any(r.sampling_params.needs_processing for r in batch.requests)
        if prev is not None and not overlap:
            outputs = self._collect_flight(prev)
        compiles = self.runner.compile_count()
        rows, lists = self._prompt_rows(batch)
        flight = _Flight(batch, sampling, self.runner.dispatch(batch, sampling, prev.pending if prev else None, rows),
                         prompt_rows=(rows, lists))
        compiled = self.runner.compile_count() > compiles
        if prev is not None and overlap:
            outputs = self._collect_flight(prev)
        if not overlap:
            jax.block_until_ready(flight.pending)  # no host work while a wide step runs on every core
        flight.placeholders = self.scheduler.advance_after_dispatch(batch)
        if overlap:
            self._flight = flight
        else:
            outputs += self._collect_flight(flight)
        self._record_step(batch, start, compiled)  # overlapped: its duration spans the wait for step k-1
        return outputs

    def _collect_flight(self, flight: _Flight) -> list[RequestOutput]:
        """Wait for a dispatched step, write its tokens over their placeholders and post-process them."""
        result = self.runner.collect(flight.pending, flight.batch, flight.sampling)
        if flight.prompt_rows[0] is not None:
            record(flight.prompt_rows[0], result.prompt_logprobs, flight.batch, flight.prompt_rows[1])
        for req, index, s in flight.placeholders:
            if not req.status.finished:  # an aborted request dropped its placeholder
                req.output_token_ids[index] = int(result.tokens[s])
        now = self.clock()
        outputs = []
        for req, _, s in flight.placeholders:
            tracked = self._tracked.get(req.request_id)
            if tracked is None or tracked.request is not req or req.status.finished:
                continue  # aborted while in flight
            try:
                outputs.append(self._postprocess(tracked, result, s, now))
            except Exception as e:  # one request's failure (e.g. detokenizing) must not stop the others
                log.exception("request %s failed", req.request_id)
                outputs.append(self._fail(tracked, f"internal error: {type(e).__name__}: {e}"))
        return outputs

    def _prompt_rows(self, batch: RaggedBatch) -> tuple[PromptRows | None, dict[int, PromptLogprobs]]:
        """The prefill rows of `batch` whose prompt logprobs their requests still miss, and those requests' lists."""
        lists = {s: t.prompt_logprobs for s, r in enumerate(batch.requests)
                 if (t := self._tracked.get(r.request_id)) is not None and t.prompt_logprobs is not None}
        return plan_rows(batch, lists), lists

    def _sampling_for(self, batch, runner: ModelRunner) -> SamplingArrays:
        """Stamp first-scheduled times and lay out each sequence's sampling row (params, seed, position)."""
        now = self.clock()
        for req in batch.requests:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        rows = [(r.sampling_params, self._tracked[r.request_id].seed, len(r.output_token_ids))
                for r in batch.requests]
        return SamplingArrays.build(rows, runner.sampling_bucket(batch.num_seqs))

    def _postprocess(self, tracked: _Tracked, result, s: int, now: float) -> RequestOutput:
        """Stamp a request's new token, record its logprobs, check its stops, and describe it. A request whose
        grammar failed (a limit reached mid-output: structured/grammar.py) fails alone."""
        req = tracked.request
        if req.grammar is not None and req.grammar.error is not None:
            return self._fail(tracked, f"{GRAMMAR_FAILED}: {req.grammar.error}")
        self.counters["generation_tokens"] += 1
        req.token_times.append(now)
        if req.first_token_time is None:
            req.first_token_time = now
        if tracked.logprobs is not None:
            tracked.logprobs.append(self._logprob_entry(result, s, req.sampling_params.logprobs or 0))
        finish = tracked.stops.check(req)
        if finish is not None:
            status, reason = finish
            req.stop_reason = reason
            req.finish_time = now
            self.scheduler.finish_request(req, status)
            del self._tracked[req.request_id]
        return self._output(tracked)

    def _fail(self, tracked: _Tracked, message: str) -> RequestOutput:
        """Abort a request that hit an internal error; its output carries the error."""
        out = self.abort_request(tracked.request.request_id) or self._output(tracked)
        out.error = message
        return out

    def _logprob_entry(self, result, s: int, k: int) -> dict[int, float]:
        entry = {int(result.tokens[s]): float(result.logprobs[s])}
        if k and result.top_ids is not None:
            entry.update({int(i): float(lp) for i, lp in zip(result.top_ids[s, :k], result.top_logprobs[s, :k],
                                                               strict=True)})
        return entry

    def _record_step(self, batch, start: float, compiled: bool) -> None:
        stats = self.scheduler.stats()
        self.counters["steps"] += 1
        self.counters["num_preemptions"] += stats.num_preemptions
        self.counters["prefix_cache_queries"] += stats.prefix_queries
        self.counters["prefix_cache_hits"] += stats.prefix_hits
        now = self.clock()
        self.last_step = StepStats(
            time=now, duration=now - start, num_tokens=batch.num_tokens,
            num_prefill_tokens=batch.num_prefill_tokens, num_decode_tokens=batch.num_decodes,
            num_running=stats.num_running, num_waiting=stats.num_waiting, kv_usage=stats.kv_usage,
            num_preemptions=stats.num_preemptions, prefix_queries=stats.prefix_queries,
            prefix_hits=stats.prefix_hits, decode_context_tokens=int(batch.kv_lens[: batch.num_decodes].sum()),
            prefill_chunks=[(int(batch.cu_q_lens[s + 1] - batch.cu_q_lens[s]),
                             int(batch.kv_lens[s] - (batch.cu_q_lens[s + 1] - batch.cu_q_lens[s])))
                            for s in range(batch.num_decodes, batch.num_seqs)],
            compiled=compiled)

    def _output(self, tracked: _Tracked) -> RequestOutput:
        req = tracked.request
        status = req.status
        finish_reason = status.value if status.finished else None
        completion = CompletionOutput(index=0, text=tracked.stops.text, token_ids=list(req.output_token_ids),
                                      finish_reason=finish_reason, stop_reason=req.stop_reason,
                                      logprobs=list(tracked.logprobs) if tracked.logprobs is not None else None)
        cached = req.num_cached_tokens or 0
        metrics = RequestMetrics(arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time,
                                 first_token_time=req.first_token_time, finish_time=req.finish_time,
                                 token_times=list(req.token_times), num_cached_tokens=cached,
                                 num_preemptions=req.num_preemptions, **spec_metrics(req))
        prompt_lp = list(tracked.prompt_logprobs) if tracked.prompt_logprobs is not None else None
        return RequestOutput(request_id=req.request_id, prompt=tracked.prompt,
                             prompt_token_ids=req.prompt_token_ids, outputs=[completion],
                             finished=status.finished, metrics=metrics, num_cached_tokens=cached,
                             prompt_logprobs=prompt_lp)

    def set_step_budget(self, max_num_batched_tokens: int, chunk_size: int | None = None) -> None:
        """Change the per-step token budget (and prefill chunk) of a running engine, within its buckets."""
        largest = self.runner.token_buckets[-1]
        chunk_size = chunk_size or max_num_batched_tokens
        if not 1 <= max_num_batched_tokens <= largest:
            raise ValueError(f"max_num_batched_tokens must be in [1, {largest}] (the largest compiled bucket)")
        if not 1 <= chunk_size <= max_num_batched_tokens:
            raise ValueError(f"chunk_size must be in [1, max_num_batched_tokens={max_num_batched_tokens}]")
        self.scheduler.config.max_num_batched_tokens = max_num_batched_tokens
        self.scheduler.config.chunk_size = chunk_size

    def stats(self) -> dict[str, float]:
        """A snapshot of the engine's gauges and counters."""
        return {"num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
                "kv_usage": self.kv_manager.usage(), "evicted_pages": self.kv_manager.num_evicted_pages,
                **self.counters, **(self.spec_decoder.stats() if self.spec_decoder else {})}
