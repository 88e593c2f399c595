"""Greedy decoding through our paged model and through HF transformers, for the per-family parity tests.

`greedy_paged` runs all prompts together as the engine does: one ragged prefill step over shuffled pages, then
batched one-token decode steps, each a jitted forward over the donated pool. `hf_greedy` is HF's `generate`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from jaxserve.model.attention.metadata import AttentionMetadata
from jaxserve.model.llama import init_kv_cache
from modelspec.spec import ModelSpec

PAGE_SIZE, NUM_PAGES, PAGES_PER_SEQ, T_PAD = 4, 64, 12, 64
PROMPTS = [[5, 17, 42, 8, 91, 3, 3, 60, 22, 71, 14, 9, 33], [7, 7, 1, 30, 2, 88, 19], [64, 12, 50, 11]]
NEW_TOKENS = 24


def randomize(model: torch.nn.Module, seed: int = 1) -> None:
    """Weights of a scale that gives O(1) logits (HF's 0.02 init makes greedy decoding degenerate)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else p.shape[-1] ** -0.5))


def greedy_paged(model: nnx.Module, spec: ModelSpec, prompts: list[list[int]], new_tokens: int,
                 cpu_kernel: bool = True) -> tuple[list[list[int]], np.ndarray]:
    """Greedy continuations of all prompts, run together: one ragged prefill step, then batched decode steps.
    Returns the tokens per prompt and the prefill step's logits of the first prompt."""
    graphdef, params = nnx.split(model)

    def step(params, caches, ids, pos, meta):
        m = nnx.merge(graphdef, params)
        hidden, caches = m(ids, pos, caches, meta, cpu_kernel=cpu_kernel)
        return m.compute_logits(hidden), caches

    step = jax.jit(step, donate_argnums=1)
    caches = init_kv_cache(spec, NUM_PAGES, PAGE_SIZE, jnp.float32)
    free = [int(p) for p in np.random.default_rng(0).permutation(np.arange(1, NUM_PAGES))]
    pages = [free[i * PAGES_PER_SEQ:(i + 1) * PAGES_PER_SEQ] for i in range(len(prompts))]
    table = np.zeros((len(prompts), PAGES_PER_SEQ), np.int32)
    for i, p in enumerate(pages):
        table[i] = p
    seqs = [list(p) for p in prompts]
    work = [(i, list(p), 0) for i, p in enumerate(prompts)]  # (seq, new tokens, first position)
    first_logits = None
    for _ in range(new_tokens):
        ids, pos, slots = (np.zeros(T_PAD, np.int32) for _ in range(3))
        cu, kv = np.zeros(len(prompts) + 1, np.int32), np.zeros(len(prompts), np.int32)
        t = 0
        for s, (seq, toks, start) in enumerate(work):
            p = np.arange(start, start + len(toks))
            ids[t:t + len(toks)], pos[t:t + len(toks)] = toks, p
            slots[t:t + len(toks)] = np.asarray(pages[seq])[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
            t += len(toks)
            cu[s + 1], kv[s] = t, start + len(toks)
        decodes = len(work) if all(len(toks) == 1 for _, toks, _ in work) else 0
        meta = AttentionMetadata(slot_mapping=jnp.asarray(slots), cu_q_lens=jnp.asarray(cu), kv_lens=jnp.asarray(kv),
                                 page_table=jnp.asarray(table), num_seqs=jnp.int32(len(work)),
                                 num_decodes=jnp.int32(decodes))
        logits, caches = step(params, caches, jnp.asarray(ids), jnp.asarray(pos), meta)
        logits = np.asarray(logits)
        if first_logits is None:
            first_logits = logits[: len(prompts[0])]
        for s in range(len(seqs)):
            seqs[s].append(int(np.argmax(logits[cu[s + 1] - 1])))
        work = [(s, [seqs[s][-1]], len(seqs[s]) - 1) for s in range(len(seqs))]
    return [s[len(p):] for s, p in zip(seqs, prompts, strict=True)], first_logits


def hf_greedy(hf: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """HF's greedy continuation of one prompt, exactly `new_tokens` long."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(hf: torch.nn.Module, prompt: list[int]) -> np.ndarray:
    """HF's logits [len(prompt), vocab] of one prompt."""
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float().numpy()
