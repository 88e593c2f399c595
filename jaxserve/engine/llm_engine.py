"""The engine: requests in, outputs out; each `step()` is one step of the loop chosen at start-up.

`LLMEngine` owns the model runner, the KV cache manager, the scheduler and each request's host state (seed, stop
checker, logprobs). How steps run is a strategy (jaxserve/engine/loops/): synchronous, overlapped (asynchronous
scheduling), k decode steps a dispatch, or speculative; a loop uses only the engine's public operations
(`sampling_for`, `prompt_rows`, `emit`, `record_step`, `seed_of`). `LLM` drives the engine to completion for a batch
of prompts and `AsyncEngine` drives it from a background thread for streaming clients.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.core.batch import RaggedBatch, is_placeholder
from jaxserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepStats
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.stops import StopChecker
from jaxserve.core.tokenizer import load_tokenizer, load_tokenizer_override
from jaxserve.core.validation import encode_prompt, resolve_max_tokens
from jaxserve.engine.loops import choose_loop
from jaxserve.platform.policy import choose_policy
from jaxserve.runner.buckets import default_token_ladder, power_of_two_ladder, speculative_round_sizes
from jaxserve.runner.logits_processing import prepare_request
from jaxserve.runner.model_builder import build_model_and_cache
from jaxserve.runner.model_runner import ModelRunner, StepResult
from jaxserve.runner.prompt_logprobs import PromptLogprobs, PromptRows, plan_rows
from jaxserve.runner.sampler import SamplingArrays
from jaxserve.scheduler.kv_cache_manager import KVCacheManager
from jaxserve.scheduler.scheduler import Scheduler, SchedulerConfig
from jaxserve.structured.grammar import GRAMMAR_FAILED
from modelspec.spec import load_model_spec

log = logging.getLogger("jaxserve")


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
        log.info("loading model %s", config.model)
        self.spec = load_model_spec(config.model)
        self.tokenizer = (load_tokenizer_override(config.tokenizer, self.spec) if config.tokenizer
                          else load_tokenizer(config.model, self.spec))
        if config.chat_template is not None:
            if self.tokenizer is None:
                raise ValueError(f"--chat-template: model {config.model} has no tokenizer to template with")
            self.tokenizer.chat_template = config.chat_template
        built = build_model_and_cache(config, self.spec)
        self.max_model_len = built.max_model_len
        self.num_pages = built.num_pages
        self.dtype = built.dtype
        token_buckets = config.token_buckets or default_token_ladder(config.max_num_batched_tokens)
        seq_buckets = config.seq_buckets or power_of_two_ladder(config.max_num_seqs)
        spec_k = config.speculative_config.num_speculative_tokens if config.speculative_config else 0
        # a fused speculative round's forward and LM head take S (k + 1) rows: the kernel plan measures those too
        round_rows = tuple(s * (spec_k + 1) for s in speculative_round_sizes(
            seq_buckets, spec_k, min(config.max_num_seqs * (1 + spec_k), max(token_buckets)))) if spec_k else ()
        self.policy = choose_policy(built.model, built.kv_caches, attention_backend=config.attention_backend,
                                    cpu_kernels=config.cpu_kernels, token_buckets=(*token_buckets, *round_rows),
                                    seq_buckets=(*seq_buckets, *round_rows),
                                    overlapped=bool(config.async_scheduling))
        self.runner = ModelRunner(built.model, built.kv_caches, self.policy, page_size=config.page_size,
                                  max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
                                  token_buckets=self.policy.token_buckets(token_buckets), seq_buckets=seq_buckets,
                                  max_logits_rows=config.max_num_seqs * (1 + spec_k))
        config.attention_backend = self.policy.ops.attention.name  # what "auto" resolved to, for /version
        if config.async_scheduling is None:  # unset: the platform's default loop
            config.async_scheduling = self.policy.async_by_default and config.supports_async_scheduling
        log.info("%s; KV cache %s", self.policy.describe(), config.kv_cache_dtype)
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
        self.loop = choose_loop(self)
        log.info("step loop: %s", self.loop.name)
        if config.warmup:
            self.runner.warmup()
            self.loop.warmup()

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
        self.loop.check(params)
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

    def step(self) -> list[RequestOutput]:
        """Run one step of the engine's loop; return an output for every request that drew a token or finished
        (with the overlapped loop, those of the step dispatched by the previous call)."""
        return self.loop.step()

    def compile_count(self) -> int:
        """Compiled variants of every step function so far (none after warm-up)."""
        return self.runner.compile_count() + self.loop.compile_count()

    # What the loops use ---------------------------------------------------------------------------------------
    def stamp_scheduled(self, batch: RaggedBatch) -> None:
        """Stamp the first-scheduled time of the batch's requests that had none."""
        now = self.clock()
        for req in batch.requests:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now

    def seed_of(self, request_id: str) -> int:
        """The sampling seed of a live request."""
        return self._tracked[request_id].seed

    def sampling_for(self, batch: RaggedBatch, runner: ModelRunner | None = None) -> SamplingArrays:
        """Stamp first-scheduled times and lay out each sequence's sampling row (params, seed, position), padded to
        `runner`'s (default: this engine's) sampling bucket."""
        self.stamp_scheduled(batch)
        rows = [(r.sampling_params, self._tracked[r.request_id].seed, len(r.output_token_ids))
                for r in batch.requests]
        return SamplingArrays.build(rows, (runner or self.runner).sampling_bucket(batch.num_seqs))

    def prompt_rows(self, batch: RaggedBatch) -> tuple[PromptRows | None, dict[int, PromptLogprobs]]:
        """The prefill rows of `batch` whose prompt logprobs their requests still miss, and those requests' lists."""
        lists = {s: t.prompt_logprobs for s, r in enumerate(batch.requests)
                 if (t := self._tracked.get(r.request_id)) is not None and t.prompt_logprobs is not None}
        return plan_rows(batch, lists), lists

    def emit(self, req: Request, result: StepResult, s: int, now: float) -> RequestOutput | None:
        """Turn row `s` of a step's result into `req`'s next output: stamp the token (already recorded in `req`),
        record its logprobs, check its stops. None when the request is no longer live (aborted while its step ran);
        a failure (e.g. in detokenizing) fails that request alone, its output carrying the error."""
        tracked = self._tracked.get(req.request_id)
        if tracked is None or tracked.request is not req or req.status.finished:
            return None
        try:
            failed = self._postprocess(tracked, result, s, now)
            return failed if failed is not None else self._output(tracked)
        except Exception as e:  # one request's failure must not stop the others
            return self._failed(req, e)

    def emit_tokens(self, req: Request, result: StepResult, rows: Sequence[int], now: float) -> RequestOutput | None:
        """Rows `rows` of a step's result as `req`'s next tokens (a decode run's, or a verify chunk's accepted
        drafts and its own token): each recorded in the request and checked against its stops in turn, the rest
        dropped once one stops it; one output describes them all (outputs are cumulative, so the ones before the
        last would only be dropped). None, as from `emit`, when the request is no longer live."""
        tracked = self._tracked.get(req.request_id)
        if tracked is None or tracked.request is not req or req.status.finished:
            return None
        try:
            for s in rows:
                self.scheduler.record_token(req, int(result.tokens[s]))
                failed = self._postprocess(tracked, result, s, now)
                if failed is not None:
                    return failed
                if req.status.finished:
                    break
            return self._output(tracked)
        except Exception as e:  # one request's failure must not stop the others
            return self._failed(req, e)

    def _failed(self, req: Request, e: Exception) -> RequestOutput | None:
        log.exception("request %s failed", req.request_id)
        return self.fail(req.request_id, f"internal error: {type(e).__name__}: {e}")

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """Abort a request that hit an internal error; its final output carries the error."""
        tracked = self._tracked.get(request_id)
        out = self.abort_request(request_id) or (self._output(tracked) if tracked is not None else None)
        if out is not None:
            out.error = message
        return out

    def record_step(self, batch: RaggedBatch, start: float, compiled: bool) -> None:
        """Count a finished step and describe it in `last_step` (what metrics and the report read)."""
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
            compiled=compiled, num_prompts_done=int(batch.samples[batch.num_decodes:].sum()))

    # Outputs --------------------------------------------------------------------------------------------------
    def _postprocess(self, tracked: _Tracked, result: StepResult, s: int, now: float) -> RequestOutput | None:
        """Stamp a request's new token, record its logprobs, check its stops (finishing it when one holds). A
        request whose grammar failed (a limit reached mid-output: structured/grammar.py) fails alone: its final
        output is returned; None otherwise."""
        req = tracked.request
        if req.grammar is not None and req.grammar.error is not None:
            return self.fail(req.request_id, f"{GRAMMAR_FAILED}: {req.grammar.error}")
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
        return None

    def _logprob_entry(self, result: StepResult, s: int, k: int) -> dict[int, float]:
        entry = {int(result.tokens[s]): float(result.logprobs[s])}
        if k and result.top_ids is not None:
            entry.update({int(i): float(lp) for i, lp in zip(result.top_ids[s, :k], result.top_logprobs[s, :k],
                                                               strict=True)})
        return entry

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
                                 num_preemptions=req.num_preemptions, spec_num_steps=req.spec_num_steps,
                                 spec_num_draft_tokens=req.spec_num_draft_tokens,
                                 spec_num_accepted_tokens=req.spec_num_accepted_tokens)
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
                **self.counters, **self.loop.stats()}
