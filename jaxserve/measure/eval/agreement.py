"""Greedy agreement between two engines: how far two models' greedy continuations of the same prompts stay equal
(a quantized model against its float original, say)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxserve.core.sampling_params import SamplingParams


def agreement_counts(xs: Sequence[Sequence[int]], ys: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """For paired continuations: (positions before each pair's first divergence, positions equal anywhere, all
    positions). After a divergence the contexts differ, so the first count is the one that measures agreement."""
    before = equal = total = 0
    for x, y in zip(xs, ys, strict=True):
        before += next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        equal += sum(p == q for p, q in zip(x, y, strict=True))
        total += len(x)
    return before, equal, total


def greedy_tokens(llm: Any, prompts: list[list[int]], max_tokens: int = 32) -> list[list[int]]:
    """`llm`'s greedy continuation of each prompt (token ids), `max_tokens` long (EOS ignored)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def greedy_agreement(a: Any, b: Any, prompts: list[list[int]], max_tokens: int = 32) -> float:
    """The fraction of the first `max_tokens` greedy positions of `prompts` at which LLMs `a` and `b` agree,
    counting each prompt's positions before its first divergence."""
    before, _, total = agreement_counts(greedy_tokens(a, prompts, max_tokens), greedy_tokens(b, prompts, max_tokens))
    return before / total
