"""Perplexity from the engine's own prompt logprobs (`SamplingParams.prompt_logprobs=0`).

Each window is one request that draws a single token; its `RequestOutput.prompt_logprobs` give log p(token_j |
window tokens before j) for every window token after the first. Perplexity is exp of the mean negative
log-likelihood over all scored tokens of all windows: the same windows and the same sum HF transformers'
log-softmax gives (tests/test_eval_perplexity.py).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.measure.eval.windows import token_windows


@dataclass(frozen=True)
class PerplexityResult:
    """What one evaluation measured."""

    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    num_tokens: int  # scored tokens
    num_windows: int
    max_len: int

    def as_dict(self) -> dict[str, float | int]:
        return {"perplexity": self.perplexity, "nll": self.nll, "num_tokens": self.num_tokens,
                "num_windows": self.num_windows, "max_len": self.max_len}


def window_nll(prompt_logprobs: list[dict[int, float] | None], window: list[int]) -> float:
    """Sum of -log p over a window's scored tokens, read from one request's prompt logprobs."""
    if len(prompt_logprobs) != len(window) or prompt_logprobs[0] is not None:
        raise ValueError("prompt logprobs do not line up with the window")
    return -sum(entry[tok] for entry, tok in zip(prompt_logprobs[1:], window[1:], strict=True))


_RUNS = itertools.count()


def perplexity(engine, ids: list[int], max_len: int) -> PerplexityResult:
    """Perplexity of `engine` (an `LLMEngine`, e.g. `LLM(...).engine`) over token ids `ids`, in windows of
    `max_len` tokens, all submitted at once (the scheduler batches them). ValueError when nothing can be scored."""
    windows = token_windows(ids, max_len)
    if not windows:
        raise ValueError("the text is shorter than two tokens: nothing to score")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    run = next(_RUNS)
    rids = [f"ppl-{run}-{i}" for i in range(len(windows))]
    for rid, w in zip(rids, windows, strict=True):
        engine.add_request(rid, w, params)
    done = {}
    while len(done) < len(rids):
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"window {out.request_id} failed: {out.error}")
            if out.finished:
                done[out.request_id] = out
    total = sum(window_nll(done[rid].prompt_logprobs, w) for rid, w in zip(rids, windows, strict=True))
    scored = sum(len(w) - 1 for w in windows)
    nll = total / scored
    return PerplexityResult(math.exp(nll), nll, scored, len(windows), max_len)
