"""Our model and loader against HF transformers' own forward, on tiny random-weight HF checkpoints.

Each checkpoint is written with `save_pretrained(safe_serialization=True)`, loaded with our loader, and run
through the paged cache (page size 4, shuffled pages) as one prefill, in chunks, token by token, and mixed
with another sequence in one step; logits must match HF's in float32 and greedy tokens must agree.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve.model.attention.metadata import AttentionMetadata  # noqa: E402
from jaxserve.model.llama import init_kv_cache  # noqa: E402
from jaxserve.model.weights import load_hf_checkpoint  # noqa: E402
from modelspec.spec import load_model_spec  # noqa: E402

jax.config.update("jax_enable_x64", False)

PAGE_SIZE, NUM_PAGES, T_PAD, S_PAD, PAGES_PER_SEQ = 4, 24, 16, 2, 8
VOCAB = 96
ATOL = 2e-4

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}
CONFIGS = {
    "llama-gqa-rope-scaling": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE)),
    "llama-tied-mqa": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2-qkv-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0,
        tie_word_embeddings=False, use_sliding_window=False)),
    "mistral-head-dim": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=None)),
}


def _randomize(model) -> None:
    """Weights of a scale that gives O(1) logits (HF's 0.02 init makes them nearly flat)."""
    g = torch.Generator().manual_seed(1)
    # A tied head with unit-norm embeddings would just echo the last token.
    embed_std = model.config.hidden_size**-0.5 if model.config.tie_word_embeddings else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (embed_std if "embed" in name else p.shape[-1] ** -0.5))


@pytest.fixture(scope="session", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(name, HF model, our model, spec) for one architecture."""
    config_cls, model_cls, kw = CONFIGS[request.param]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256, **kw)
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(config).eval()
    _randomize(hf)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    spec = load_model_spec(str(folder))
    model = load_hf_checkpoint(folder, spec, jnp.float32)
    return request.param, hf, Compiled(model), spec


def hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


class Compiled:
    """The model split into graph and params with its one jitted step (shared by a checkpoint's tests)."""

    def __init__(self, model):
        self.graphdef, self.params = nnx.split(model)
        self.step_fn = jax.jit(self._step, donate_argnums=1)

    def _step(self, params, caches, ids, pos, meta):
        model = nnx.merge(self.graphdef, params)
        hidden, caches = model(ids, pos, caches, meta)
        return model.compute_logits(hidden), caches


class PagedRunner:
    """A minimal stand-in for the model runner: shuffled pages per sequence, one padded bucket."""

    def __init__(self, compiled: Compiled, spec, seed: int = 0):
        self.compiled = compiled
        self.caches = init_kv_cache(spec, NUM_PAGES, PAGE_SIZE, jnp.float32)
        self.free = list(np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES)))
        self.pages: dict[int, list[int]] = {}

    def step(self, work: list[tuple[int, list[int], int]]) -> list[np.ndarray]:
        """work: (seq, new token ids, first position), decodes first. Returns logits [q_len, vocab] per item."""
        ids, pos, slots = np.zeros(T_PAD, np.int32), np.zeros(T_PAD, np.int32), np.zeros(T_PAD, np.int32)
        cu, kv = np.zeros(S_PAD + 1, np.int32), np.zeros(S_PAD, np.int32)
        table = np.zeros((S_PAD, PAGES_PER_SEQ), np.int32)
        t = 0
        for s, (seq, toks, start) in enumerate(work):
            pages = self.pages.setdefault(seq, [])
            end = start + len(toks)
            while len(pages) * PAGE_SIZE < end:
                pages.append(int(self.free.pop()))
            p = np.arange(start, end)
            ids[t : t + len(toks)], pos[t : t + len(toks)] = toks, p
            slots[t : t + len(toks)] = np.asarray(pages)[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
            t += len(toks)
            cu[s + 1], kv[s], table[s, : len(pages)] = t, end, pages
        cu[len(work) + 1 :] = t
        num_decodes = 0
        while num_decodes < len(work) and len(work[num_decodes][1]) == 1 and work[num_decodes][2] > 0:
            num_decodes += 1
        meta = AttentionMetadata(slot_mapping=jnp.asarray(slots), cu_q_lens=jnp.asarray(cu), kv_lens=jnp.asarray(kv),
                                 page_table=jnp.asarray(table), num_seqs=jnp.int32(len(work)),
                                 num_decodes=jnp.int32(num_decodes))
        logits, self.caches = self.compiled.step_fn(self.compiled.params, self.caches, jnp.asarray(ids),
                                                    jnp.asarray(pos), meta)
        logits = np.asarray(logits)
        return [logits[cu[s] : cu[s + 1]] for s in range(len(work))]


PROMPT = [5, 17, 42, 8, 91, 3, 3, 60, 22, 71, 14, 9, 33]


def test_single_prefill(checkpoint):
    _, hf, model, spec = checkpoint
    (ours,) = PagedRunner(model, spec).step([(0, PROMPT, 0)])
    np.testing.assert_allclose(ours, hf_logits(hf, PROMPT), atol=ATOL, rtol=ATOL)


def test_chunked_prefill(checkpoint):
    _, hf, model, spec = checkpoint
    runner = PagedRunner(model, spec, seed=1)
    chunks = [PROMPT[:5], PROMPT[5:9], PROMPT[9:]]
    out, start = [], 0
    for c in chunks:
        out += runner.step([(0, c, start)])
        start += len(c)
    np.testing.assert_allclose(np.concatenate(out), hf_logits(hf, PROMPT), atol=ATOL, rtol=ATOL)


def test_decode_token_by_token_and_greedy(checkpoint):
    _, hf, model, spec = checkpoint
    runner = PagedRunner(model, spec, seed=2)
    out = [runner.step([(0, [tok], i)])[0] for i, tok in enumerate(PROMPT)]
    np.testing.assert_allclose(np.concatenate(out), hf_logits(hf, PROMPT), atol=ATOL, rtol=ATOL)
    # Greedy continuation, decode steps through the paged cache vs HF's greedy generate.
    ids, last = list(PROMPT), out[-1][-1]
    for _ in range(8):
        ids.append(int(np.argmax(last)))
        last = runner.step([(0, [ids[-1]], len(ids) - 1)])[0][-1]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0].tolist()
    assert ids == ref


def test_mixed_decode_and_prefill_in_one_step(checkpoint):
    _, hf, model, spec = checkpoint
    runner = PagedRunner(model, spec, seed=3)
    other = [7, 7, 1, 30, 2, 88, 19]
    runner.step([(0, PROMPT[:-1], 0)])  # sequence 0 prefilled but for its last token
    decode, chunk = runner.step([(0, PROMPT[-1:], len(PROMPT) - 1), (1, other, 0)])
    np.testing.assert_allclose(decode[0], hf_logits(hf, PROMPT)[-1], atol=ATOL, rtol=ATOL)
    np.testing.assert_allclose(chunk, hf_logits(hf, other), atol=ATOL, rtol=ATOL)
