"""Logits processing before sampling, as vLLM defines it: bans (bad words, min_tokens, a grammar's bitmask),
`logit_bias`, then repetition, frequency and presence penalties.

The host lays out fixed-shape arrays per step (`Processing.build`, only when some row of the batch needs them);
the jitted `process_logits` applies them to the whole batch at once: no loop over tokens or vocabulary on the
host. Shapes depend only on the sampling bucket, the vocabulary and the context length, so the processed sampler
compiles once per sampling bucket, at warm-up. Rows that need nothing carry neutral values.

- bans and grammars: one int32 bitmask [S, ceil(V/32)] of allowed tokens (bit t % 32 of word t // 32); all ones
  allows everything; a grammar writes its row, bans clear bits. A row left with no allowed token keeps its
  unprocessed logits.
- `logit_bias`: [S, MAX_LOGIT_BIAS] (token id, bias) pairs, pads pointing past the vocabulary (dropped).
- penalties: each row's prompt and output ids [S, H] (H = the context length; -1 pads) and prompt length; the
  device counts them into [S, V] with one scatter. Rows without penalties carry neutral ones (presence and
  frequency 0, repetition 1), which leave their logits exactly as they were: no conditional in the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.batch import is_placeholder
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import MAX_LOGIT_BIAS
from jaxserve.structured.grammar import matcher as grammar_matcher


def bitmask_words(vocab: int) -> int:
    """int32 words of a vocabulary's bitmask."""
    return (vocab + 31) // 32


def ban(mask_row: np.ndarray, token_ids: list[int] | np.ndarray) -> None:
    """Clear the bits of `token_ids` (those inside the vocabulary) in one row of an int32 bitmask."""
    ids = np.asarray(token_ids, np.int64)
    ids = ids[(ids >= 0) & (ids < mask_row.shape[0] * 32)]
    words = mask_row.view(np.uint32)
    np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))


@dataclass
class Processing:
    """Host arrays of one step's logits processing, S rows (see the module docstring)."""

    penalties: np.ndarray  # [S, 3] f32: presence, frequency, repetition
    history: np.ndarray  # [S, H] i32: prompt then output ids, -1 pads
    num_prompt: np.ndarray  # [S] i32
    bias_ids: np.ndarray  # [S, MAX_LOGIT_BIAS] i32, pads = vocab
    bias_values: np.ndarray  # [S, MAX_LOGIT_BIAS] f32
    allowed: np.ndarray  # [S, ceil(V/32)] i32 bitmask

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.penalties, self.history, self.num_prompt, self.bias_ids, self.bias_values, self.allowed

    @classmethod
    def neutral(cls, size: int, vocab: int, history_len: int) -> Processing:
        """Rows that change nothing."""
        penalties = np.zeros((size, 3), np.float32)
        penalties[:, 2] = 1.0
        return cls(penalties=penalties, history=np.full((size, history_len), -1, np.int32),
                   num_prompt=np.zeros(size, np.int32), bias_ids=np.full((size, MAX_LOGIT_BIAS), vocab, np.int32),
                   bias_values=np.zeros((size, MAX_LOGIT_BIAS), np.float32),
                   allowed=np.full((size, bitmask_words(vocab)), -1, np.int32))

    @classmethod
    def build(cls, requests: list, size: int, vocab: int, history_len: int) -> Processing | None:
        """Rows for `requests` (scheduler Requests; None entries are neutral), or None when none needs processing.
        A request's grammar (`Request.grammar`) is advanced to its output and writes its row of the bitmask."""
        if not any(r is not None and r.sampling_params.needs_processing for r in requests):
            return None
        out = cls.neutral(size, vocab, history_len)
        for i, req in enumerate(requests):
            if req is None or not req.sampling_params.needs_processing:
                continue
            p = req.sampling_params
            outputs = [t for t in req.output_token_ids if not is_placeholder(t)]
            if req.grammar is not None:
                req.grammar.fill(out.allowed[i], outputs)
            if p.has_penalties:
                out.penalties[i] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
                ids = (req.prompt_token_ids + outputs)[:history_len]
                out.history[i, : len(ids)] = ids
                out.num_prompt[i] = req.num_prompt_tokens
            if p.logit_bias:
                out.bias_ids[i, : len(p.logit_bias)] = list(p.logit_bias)
                out.bias_values[i, : len(p.logit_bias)] = list(p.logit_bias.values())
            banned = []
            if len(outputs) < p.min_tokens:  # vLLM: EOS (unless ignored) and stop ids wait for min_tokens
                banned += p.stop_token_ids
                if not p.ignore_eos and req.eos_token_id is not None:
                    banned.append(req.eos_token_id)
            for word in p.bad_words_token_ids or []:
                if len(word) == 1 or (len(outputs) >= len(word) - 1 and outputs[len(outputs) - len(word) + 1:]
                                      == word[:-1]):
                    banned.append(word[-1])
            if banned:
                ban(out.allowed[i], banned)
        return out


def prepare_request(req: Request, tokenizer: Any, vocab_size: int, multi_host: bool = False) -> None:
    """At submission, the host state a request's processing needs: its bad words as token ids, its grammar's
    matcher (a bad grammar raises GrammarError, a ValueError)."""
    p = req.sampling_params
    if p.needs_processing and multi_host:  # followers hold no requests to build the arrays from
        raise ValueError("logits processing (penalties, logit_bias, bans, grammars) needs a single-host engine")
    p.update_from_tokenizer(tokenizer)
    if p.structured_outputs is not None:
        req.grammar = grammar_matcher(p.structured_outputs, tokenizer, vocab_size)


def process_logits(logits: jax.Array, penalties: jax.Array, history: jax.Array, num_prompt: jax.Array,
                   bias_ids: jax.Array, bias_values: jax.Array, allowed: jax.Array) -> jax.Array:
    """float32 logits [S, V] after bans, logit_bias and penalties, in vLLM's order."""
    s, v = logits.shape
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    ok = bits.reshape(s, -1)[:, :v].astype(bool)
    rows = jnp.arange(s)[:, None]
    out = jnp.where(ok, logits, -jnp.inf)
    out = out.at[rows, bias_ids].add(bias_values, mode="drop")

    valid = history >= 0
    idx = jnp.where(valid, history, v)  # pads point past the vocabulary: dropped
    in_output = valid & (jnp.arange(history.shape[1])[None, :] >= num_prompt[:, None])
    counts = jnp.zeros((s, v), jnp.float32).at[rows, idx].add(in_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((s, v), bool).at[rows, idx].set(True, mode="drop")
    rep = penalties[:, 2:3]
    out = jnp.where(seen, jnp.where(out > 0, out / rep, out * rep), out)
    out = out - penalties[:, 1:2] * counts - penalties[:, 0:1] * (counts > 0)
    return jnp.where(jnp.any(out > -jnp.inf, axis=-1, keepdims=True), out, logits)

