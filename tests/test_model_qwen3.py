"""Qwen3 (per-head q/k RMSNorm, no qkv bias) against HF transformers on a random-weight checkpoint.

The test writes a tiny `Qwen3ForCausalLM` with `save_pretrained` (sharded, to exercise the index), loads it with
our loader and decodes several prompts greedily through the paged cache (shuffled pages, all prompts in one
ragged step, then batched decode steps): tokens must equal HF's `generate`, logits match in float32. Qwen3 runs
the dense fast path: the C++ CPU kernels for matmuls and attention where they apply, as Llama does.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve.model.checkpoint import save_hf_checkpoint  # noqa: E402
from jaxserve.model.llama import LlamaForCausalLM  # noqa: E402
from jaxserve.model.weights import load_hf_checkpoint  # noqa: E402
from modelspec.spec import load_model_spec  # noqa: E402
from tests.model_parity import NEW_TOKENS, PROMPTS, greedy_paged, hf_greedy, hf_logits, randomize  # noqa: E402


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(HF model, our model, spec) of one random Qwen3 checkpoint: GQA 4:2, head_dim 32 != hidden / heads."""
    config = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    randomize(hf)
    folder = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(folder, safe_serialization=True, max_shard_size="20KB")
    spec = load_model_spec(str(folder))
    return hf, load_hf_checkpoint(folder, spec, jnp.float32), spec


def test_qwen3_spec_reads_the_config(qwen3):
    _, model, spec = qwen3
    assert spec.architecture == "qwen3" and spec.qk_norm and not spec.qkv_bias and spec.head_dim == 32
    assert model.layers[0].attn.q_norm.weight[...].shape == (32,)


def test_qwen3_greedy_tokens_match_hf(qwen3):
    hf, model, spec = qwen3
    ours, prefill_logits = greedy_paged(model, spec, PROMPTS, NEW_TOKENS)
    np.testing.assert_allclose(prefill_logits, hf_logits(hf, PROMPTS[0]), atol=2e-4, rtol=2e-4)
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        assert tokens == hf_greedy(hf, prompt, NEW_TOKENS)


def test_qwen3_export_round_trips_through_hf(tmp_path, qwen3):
    """Our exporter writes q_norm/k_norm: HF reads back a seeded model of ours and decodes as ours does."""
    _, _, spec = qwen3
    model = LlamaForCausalLM(spec, jnp.float32, rngs=nnx.Rngs(3))
    save_hf_checkpoint(model, spec, tmp_path)
    back = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
    ours, _ = greedy_paged(model, spec, PROMPTS[:1], 8)
    assert ours[0] == hf_greedy(back, PROMPTS[0], 8)
