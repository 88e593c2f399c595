"""`LLM`: the offline, vLLM-style Python entry point."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from jaxserve.config.engine import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.factory import create_engine

Prompt = str | list[int]


class LLM:
    """An engine that lives as long as this object (its prefix cache too), driven to completion per call.

    >>> llm = LLM(model="tiny")
    >>> out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0]
    >>> len(out.token_ids) <= 8
    True
    """

    def __init__(self, model: str = "tiny", **engine_args) -> None:
        self.engine = create_engine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); one output per prompt, in order.

        `sampling_params` is one SamplingParams for all prompts or a list with one per prompt. With n > 1 a
        prompt's output holds n completions (seeded ones use seed, seed+1, ...).
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, Sequence)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        groups: list[list[str]] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids = []
                for i in range(p.n):
                    sub = p if p.n == 1 else dataclasses.replace(
                        p, n=1, seed=None if p.seed is None else p.seed + i)
                    rid = f"gen-{next(self._ids)}"
                    self.engine.add_request(rid, prompt, sub, cache_salt=cache_salt)
                    ids.append(rid)
                groups.append(ids)
        except ValueError:
            for rid in itertools.chain.from_iterable(groups):
                self.engine.abort_request(rid)
            raise
        finished = self._run_to_completion()
        return [self._merge([finished[rid] for rid in ids]) for ids in groups]

    def _run_to_completion(self) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return finished

    @staticmethod
    def _merge(outs: list[RequestOutput]) -> RequestOutput:
        first = outs[0]
        if len(outs) == 1:
            return first
        completions = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
        return dataclasses.replace(first, outputs=completions)
