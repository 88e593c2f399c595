"""The speculative loop: propose, schedule, verify in the ragged step, keep what was accepted.

Every decoding request with room proposes up to k tokens (`spec_token_ids`); the scheduler gives it 1 + drafts
query rows (cut to the step's token budget and the free pages) beside the other sequences' decodes and prefill
chunks; the target runs the whole batch in one forward and the rejection sampler checks every row; each request
keeps its accepted drafts and one token of its own. The KV of rejected rows is rolled back: the request's computed
length ends after its last accepted token, its pages past that are freed, and the prefix cache, which only ever
inserts computed pages, never sees a rejected token.

A round of decodes only (every sequence a verify chunk or a plain decode) runs as one dispatch
(`spec_decode/round.py`): the draft model's steps, the target's verify forward and the acceptance in one jitted
call, one small read. Other steps (a prefill chunk beside the decodes) run the proposer, the target's forward and
the verifier's call back to back. With `async_scheduling`, a round of decodes is left in flight, and the next step
dispatches the round after it, chained on the device (`spec_decode/chain.py`), before it collects it: the host's
commit of round r and its layout of round r + 2 overlap round r + 1 on the device. The proposers and the verifier
live in jaxserve/spec_decode/.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.core.batch import RaggedBatch
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.request import RequestStatus
from jaxserve.engine.loops.base import StepLoop
from jaxserve.runner.model_runner import StepResult
from jaxserve.spec_decode.chain import chain_batch
from jaxserve.spec_decode.draft import DraftProposer
from jaxserve.spec_decode.ngram import NgramProposer, draft_room
from jaxserve.spec_decode.round import FusedRound
from jaxserve.spec_decode.verify import Verifier, VerifyResult


@dataclass
class SpecCounters:
    """vLLM's spec-decode counters over the engine's life."""

    num_drafts: int = 0  # verify rows groups: sequences x steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at each position
    num_chained: int = 0  # rounds dispatched while the round before them was still in flight
    num_empty: int = 0  # rounds whose device lookup found a draft for no sequence (one token each, a round's cost)

    def as_stats(self) -> dict[str, float]:
        out = {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
               "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
               "spec_decode_num_chained_rounds": self.num_chained, "spec_decode_num_empty_rounds": self.num_empty}
        out.update({f"spec_decode_num_accepted_tokens_pos{i}": n for i, n in enumerate(self.accepted_per_pos)})
        return out


@dataclass
class Flight:
    """A round dispatched and not yet collected."""

    batch: RaggedBatch
    pending: tuple  # FusedRound.dispatch's (results, carry) on the device
    want_logprobs: bool
    start: float
    compiles: int  # compiled variants when it was prepared


class SpeculativeLoop(StepLoop):
    """Speculative decoding's steps: owns the proposer and the verifier; uses the engine's scheduler and outputs."""

    name = "speculative"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        config: SpeculativeConfig = engine.config.speculative_config
        target_spec, num_pages = engine.spec, engine.num_pages
        self.config = config
        k = self.k = config.num_speculative_tokens
        tp = engine.config.tensor_parallel_size
        if config.draft_tensor_parallel_size not in (None, tp):
            raise ValueError(f"speculative_config: the draft runs on the target's devices "
                             f"(draft_tensor_parallel_size must be {tp}, got {config.draft_tensor_parallel_size})")
        self.ngram = (NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.draft = (DraftProposer(engine.config, config.model, k, engine.runner, target_spec, num_pages,
                                    engine.max_model_len) if config.method == "draft_model" else None)
        self.verifier = Verifier(engine.runner, k, point_mass=self.ngram is not None,
                                 vocab_size=target_spec.vocab_size)
        self.overlap = bool(engine.config.async_scheduling)
        # only chained rounds (the overlapped loop's) look proposals up on the device
        self.round = FusedRound(engine.runner, k, self.draft, self.ngram if self.overlap else None)
        self.flight: Flight | None = None
        self.counters = SpecCounters(accepted_per_pos=[0] * k)

    def check(self, params) -> None:
        """ValueError for what the verify step does not apply: logits processing (penalties, bias, bans, grammars)
        and prompt logprobs."""
        if getattr(params, "needs_processing", False):  # runner/logits_processing.py's features
            raise ValueError("penalties, logit_bias, min_tokens, bad_words and structured outputs are not supported "
                             "with speculative decoding")
        if getattr(params, "prompt_logprobs", None) is not None:
            raise ValueError("prompt_logprobs is not supported with speculative decoding")

    def warmup(self) -> None:
        self.verifier.warmup()
        if self.draft is not None:
            self.draft.warmup()
        self.round.warmup()

    def compile_count(self) -> int:
        return (self.verifier.compile_count() + self.round.compile_count()
                + (self.draft.compile_count() if self.draft is not None else 0))

    def stats(self) -> dict[str, float]:
        return self.counters.as_stats()

    def step(self) -> list[RequestOutput]:
        """One step: with a round in flight, dispatch the one after it where it can follow on the device, then
        collect it; else propose, schedule, verify (a round of decodes left in flight under async scheduling)."""
        if self.flight is None:
            return self._step()
        flight, self.flight = self.flight, None
        self.flight = self._chain(flight)
        outputs = self._collect(flight, trim=self.flight is None)
        if self.flight is None:
            return outputs + self._step()
        self.engine.scheduler.clear_step_stats()  # the chained round was not scheduled: it counts none again
        return outputs

    def _chain(self, flight: Flight) -> Flight | None:
        """The round after `flight`, dispatched before it is collected (`spec_decode/chain.py`): only while the
        same requests run, in the same order, and nothing waits (no admission, no preemption)."""
        eng = self.engine
        sched = eng.scheduler
        if sched.waiting or [id(r) for r in sched.running] != [id(r) for r in flight.batch.requests]:
            return None
        if not eng.runner.policy.overlaps(len(sched.running) * (self.k + 1)):
            return None
        start, compiles = eng.clock(), eng.compile_count()
        runner = eng.runner
        chained = chain_batch(flight.batch, eng.kv_manager, self.k, eng.max_model_len,
                              (runner.max_num_seqs, runner.max_sampled) if self.round.lookup is not None else None)
        if chained is None:
            return None
        batch, steps, lookup = chained
        seeds = [eng.seed_of(req.request_id) for req in batch.requests]
        inputs = self.round.prepare(batch, seeds, steps, set(sched.requests), link=list(range(batch.num_seqs)),
                                    lookup=lookup)
        pending = self.round.dispatch(inputs, carry=flight.pending[1])
        self.counters.num_chained += 1
        return Flight(batch, pending, inputs.sampling.want_logprobs, start, compiles)

    def _collect(self, flight: Flight, trim: bool) -> list[RequestOutput]:
        """Wait for a round, keep what it accepted (rolling back the rest's pages when `trim`: no round after it
        in flight) and count it."""
        eng = self.engine
        result = VerifyResult(*self.round.collect(flight.pending, len(flight.batch.logits_indices),
                                                  flight.want_logprobs))
        self.counters.num_empty += result.num_drafts is not None and not result.num_drafts.any()
        outputs = self._commit(flight.batch, result, trim)
        eng.record_step(flight.batch, flight.start, eng.compile_count() > flight.compiles)
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One step from the host's state: propose, schedule, verify, commit."""
        eng = self.engine
        start = eng.clock()
        sched = eng.scheduler
        if self.ngram is not None:
            self.ngram.prepare(sched.running, eng.max_model_len)
        else:  # placeholders: the draft fills them once the scheduler has cut their number and given them pages
            for req in sched.running:
                req.spec_token_ids = [0] * draft_room(req, self.k, eng.max_model_len)
        batch = sched.schedule()  # a request left out keeps stale proposals, replaced before its next schedule
        if batch is None:
            return []
        compiles = eng.compile_count()
        if self.draft is None and not np.any(batch.num_drafts):  # lookup found nothing: a plain step's own path
            sampling = eng.sampling_for(batch)
            plain = eng.runner.execute(batch, sampling)
            no = np.zeros(len(plain.tokens), bool)
            result = VerifyResult(no, plain.tokens, plain.logprobs, plain.top_ids, plain.top_logprobs)
            outputs = self._commit(batch, result)
            eng.record_step(batch, start, eng.compile_count() > compiles)
            return outputs
        eng.stamp_scheduled(batch)
        seeds = [eng.seed_of(req.request_id) for req in batch.requests]
        if self.round.accepts(batch):  # decodes only: the whole round in one dispatch
            inputs = self.round.prepare(batch, seeds, [len(r.output_token_ids) for r in batch.requests],
                                        set(sched.requests))
            flight = Flight(batch, self.round.dispatch(inputs), inputs.sampling.want_logprobs, start, compiles)
            if self.overlap and eng.runner.policy.overlaps(batch.num_tokens):
                self.flight = flight  # collected by the next step, after it dispatches the round that follows
                return []
            return self._collect(flight, trim=True)
        q_flat, q_index = None, np.zeros(len(batch.logits_indices), np.int32)
        if self.draft is not None:
            q_flat, q_index = self.draft.propose(batch, seeds, set(sched.requests))
        rows, drafts = [], []
        for s, req in enumerate(batch.requests):
            n = int(batch.num_drafts[s])
            rows += [(req.sampling_params, seeds[s], len(req.output_token_ids) + j) for j in range(n + 1)]
            drafts += req.spec_token_ids[:n] + [-1]
        sampling, d, qi = self.verifier.rows(batch, rows, np.array(drafts, np.int32), q_index)
        result = self.verifier.execute(batch, sampling, d, qi, q_flat)
        compiled = eng.compile_count() > compiles
        outputs = self._commit(batch, result)
        eng.record_step(batch, start, compiled)
        return outputs

    def _commit(self, batch: RaggedBatch, result, trim: bool = True) -> list[RequestOutput]:
        """Keep each request's accepted drafts and its own token, stop checks after each; roll back the rest (its
        pages too when `trim`; a round in flight may write into them otherwise)."""
        eng = self.engine
        kv = eng.kv_manager
        now = eng.clock()
        per_token = StepResult(result.tokens, result.logprobs, result.top_ids, result.top_logprobs)
        outputs = []
        row = 0
        for s, req in enumerate(batch.requests):
            n = int(batch.num_drafts[s])  # draft rows; of them the device's lookup may have filled fewer
            first, row = row, row + n + 1
            drafted = n if result.num_drafts is None else int(result.num_drafts[s])
            req.spec_token_ids = []
            if req.status != RequestStatus.RUNNING:
                continue
            if not batch.samples[s]:  # a prefill chunk that does not finish its prompt
                req.num_computed_tokens = int(batch.kv_lens[s])
                kv.cache_full_pages(req)
                continue
            accepted = int(np.argmin(np.append(result.accepted[first: first + n], False)))
            start = req.num_computed_tokens
            self._count(drafted, accepted)
            if self.draft is not None:
                self.draft.after_verify(req.request_id, start, n, accepted)
            req.spec_num_steps += int(drafted > 0)
            req.spec_num_draft_tokens += drafted
            req.spec_num_accepted_tokens += accepted
            out = eng.emit_tokens(req, per_token, range(first, first + accepted + 1), now)
            if out is not None:
                outputs.append(out)
                if trim and not out.finished:
                    kv.trim(req)
        return outputs

    def _count(self, n: int, accepted: int) -> None:
        c = self.counters
        if n:
            c.num_drafts += 1
            c.num_draft_tokens += n
            c.num_accepted_tokens += accepted
            for i in range(accepted):
                c.accepted_per_pos[i] += 1
