"""HF transformers (torch) as a peer on this CPU: the random-weight Llama of a jaxserve preset, its timed `generate`
and its greedy tokens. `bench_vs_hf.py` times it; `llamacpp_peer.py` converts it to GGUF."""

from __future__ import annotations

import time


def hf_model(spec, threads: int):
    """A transformers LlamaForCausalLM shaped like `spec`, random weights from seed 0, with `threads` torch threads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    cfg = LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                      intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                      num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                      head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
                      rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
                      tie_word_embeddings=spec.tie_word_embeddings)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def hf_run(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for HF's greedy `generate` of `new_tokens` after each prompt, all prompts in one batch."""
    import torch

    ids = torch.tensor(prompts)
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF's greedy continuation of each prompt."""
    import torch

    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()
