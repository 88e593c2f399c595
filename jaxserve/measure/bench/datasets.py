"""Seeded synthetic workloads as token ids: random, shared-prefix, multi-turn and long-prompt.

Each generator returns `SampleRequest`s. A request may depend on another one (`wait_for`): a multi-turn
follow-up waits until the previous turn has finished; the long prompt of `long-prompt` waits until the first
running request has drawn `wait_tokens` tokens, so it lands while the others are decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "shared-prefix", "multi-turn", "long-prompt")


@dataclass
class SampleRequest:
    """One benchmark request: prompt ids, the output tokens to draw, and an optional dependency."""

    prompt: list[int]
    output_len: int
    wait_for: int | None = None  # index of a request that must progress first
    wait_tokens: int | None = None  # None: until `wait_for` finished; n: until it has n output tokens
    conversation: int | None = None  # multi-turn: conversation id
    role: str = "request"  # "request", "decode" or "long" (long-prompt)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


@dataclass
class DatasetConfig:
    """Knobs of the generators (names follow `vllm bench serve`)."""

    name: str = "random"
    num_prompts: int = 100
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0  # lengths uniform in [L(1-r), L(1+r)]
    prefix_len: int = 256  # shared-prefix: tokens shared within a group
    num_prefixes: int = 4  # shared-prefix: groups
    turns: int = 4  # multi-turn: turns per conversation
    long_prompt_len: int = 4096  # long-prompt: the prompt that lands mid-decode
    warm_tokens: int = 8  # long-prompt: output tokens the first decode draws before the long prompt is sent
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; choose from {', '.join(DATASETS)}")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be positive")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")


def _lengths(rng: np.random.Generator, n: int, mean: int, ratio: float) -> np.ndarray:
    """n lengths uniform on [mean(1-r), mean(1+r)], at least 1."""
    if ratio == 0:
        return np.full(n, mean, dtype=np.int64)
    lo, hi = max(1, int(round(mean * (1 - ratio)))), max(1, int(round(mean * (1 + ratio))))
    return rng.integers(lo, hi + 1, size=n)


def _tokens(rng: np.random.Generator, n: int, vocab: int, avoid: tuple[int, ...]) -> list[int]:
    """n random ids in [0, vocab) avoiding special ids (EOS would end a request early)."""
    ids = rng.integers(0, vocab, size=int(n))
    for a in avoid:
        ids[ids == a] = (a + 1) % vocab
    return ids.tolist()


def generate(cfg: DatasetConfig, vocab_size: int, special_ids: tuple[int, ...] = ()) -> list[SampleRequest]:
    """The requests of `cfg`, reproducible from `cfg.seed`."""
    rng = np.random.default_rng(cfg.seed)
    fn = {"random": random_requests, "shared-prefix": shared_prefix_requests, "multi-turn": multi_turn_requests,
          "long-prompt": long_prompt_requests}[cfg.name]
    return fn(cfg, rng, vocab_size, special_ids)


def random_requests(cfg: DatasetConfig, rng: np.random.Generator, vocab: int,
                    avoid: tuple[int, ...] = ()) -> list[SampleRequest]:
    """Independent random prompts."""
    ins = _lengths(rng, cfg.num_prompts, cfg.input_len, cfg.range_ratio)
    outs = _lengths(rng, cfg.num_prompts, cfg.output_len, cfg.range_ratio)
    return [SampleRequest(_tokens(rng, i, vocab, avoid), int(o)) for i, o in zip(ins, outs, strict=True)]


def shared_prefix_requests(cfg: DatasetConfig, rng: np.random.Generator, vocab: int,
                           avoid: tuple[int, ...] = ()) -> list[SampleRequest]:
    """`num_prefixes` groups; every prompt is its group's prefix plus a random suffix (input_len in all)."""
    prefix_len = min(cfg.prefix_len, cfg.input_len - 1)
    prefixes = [_tokens(rng, prefix_len, vocab, avoid) for _ in range(max(1, cfg.num_prefixes))]
    suffix = _lengths(rng, cfg.num_prompts, cfg.input_len - prefix_len, cfg.range_ratio)
    outs = _lengths(rng, cfg.num_prompts, cfg.output_len, cfg.range_ratio)
    return [SampleRequest(prefixes[k % len(prefixes)] + _tokens(rng, s, vocab, avoid), int(o))
            for k, (s, o) in enumerate(zip(suffix, outs, strict=True))]


def multi_turn_requests(cfg: DatasetConfig, rng: np.random.Generator, vocab: int,
                        avoid: tuple[int, ...] = ()) -> list[SampleRequest]:
    """Conversations of `turns` turns; turn k's prompt is turn k-1's prompt + an answer + a new message.

    The answer here is a stand-in of output_len ids; the in-process driver replaces it with the model's real
    answer when it sends the next turn (as a chat client does), so the whole conversation so far is a prefix
    the cache can serve. Each turn waits for the previous one to finish. `input_len` is per user message.
    """
    turns = max(1, cfg.turns)
    convs = max(1, cfg.num_prompts // turns)
    out: list[SampleRequest] = []
    for c in range(convs):
        history: list[int] = []
        prev: int | None = None
        for _ in range(turns):
            msg = int(_lengths(rng, 1, cfg.input_len, cfg.range_ratio)[0])
            o = int(_lengths(rng, 1, cfg.output_len, cfg.range_ratio)[0])
            prompt = history + _tokens(rng, msg, vocab, avoid)
            out.append(SampleRequest(prompt, o, wait_for=prev, conversation=c))
            prev = len(out) - 1
            history = prompt + _tokens(rng, o, vocab, avoid)
    return out


def long_prompt_requests(cfg: DatasetConfig, rng: np.random.Generator, vocab: int,
                         avoid: tuple[int, ...] = ()) -> list[SampleRequest]:
    """`num_prompts - 1` short requests that decode while one `long_prompt_len` prompt arrives.

    The decodes draw `output_len` tokens: enough to span the long prompt's prefill plus a tail, so the
    caller sizes output_len from the chunk size (e.g. warm + prompt/chunk + 16). The long prompt draws 4 tokens.
    """
    n = max(1, cfg.num_prompts - 1)
    out = [SampleRequest(_tokens(rng, cfg.input_len, vocab, avoid), cfg.output_len, role="decode")
           for _ in range(n)]
    out.append(SampleRequest(_tokens(rng, cfg.long_prompt_len, vocab, avoid), 4, wait_for=0,
                             wait_tokens=cfg.warm_tokens, role="long"))
    return out


DEFAULT_INPUT_LEN = 512  # `bench serve`'s prompt length where the context allows it
DEFAULT_OUTPUT_LEN = 64


def fit_lengths(max_model_len: int, name: str = "random", turns: int = 1, range_ratio: float = 0.0,
                input_len: int | None = None, output_len: int | None = None) -> tuple[int, int]:
    """Prompt and output lengths for a server of context `max_model_len`: the ones given, else the defaults
    (512 in, 64 out) shrunk so the longest request of the dataset fits (a multi-turn conversation's last turn holds
    every earlier message and answer). Raises ValueError when nothing fits."""
    scale = 1 + range_ratio
    messages = turns if name == "multi-turn" else 1
    if output_len is None:
        output_len = max(1, min(DEFAULT_OUTPUT_LEN, max_model_len // (8 * messages)))
    if input_len is None:
        room = max_model_len // messages - output_len * scale
        input_len = min(DEFAULT_INPUT_LEN, int(room / scale))
    if input_len < 1:
        raise ValueError(f"--output-len {output_len} leaves no room for a prompt in max_model_len {max_model_len}")
    return input_len, output_len
