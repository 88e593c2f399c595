"""DeepSeek-V2 (multi-head latent attention, shared + routed experts) against HF transformers.

Two random checkpoints: V2-Lite's shape (no query compression, greedy top-k) with a latent row of 48 + 16 = 64
(the C++ CPU attention kernel's width) and V2's (compressed queries, group-limited top-k, routed scaling) with a
row of 32 + 16 = 48 (the jnp reference). Each decodes several prompts greedily through the paged pool, which holds
one latent row per token and layer, and must give HF's tokens. The pool's size is the planner's formula.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.config.engine import EngineConfig  # noqa: E402
from jaxserve.model.llama import LlamaForCausalLM, init_kv_cache, kv_cache_bytes, planner_kv_bytes  # noqa: E402
from jaxserve.model.weights import load_hf_checkpoint  # noqa: E402
from jaxserve.runner.model_builder import build_model_and_cache  # noqa: E402
from jaxserve.runner.parallel import check_tp  # noqa: E402
from modelspec.memory import kv_bytes_per_token, kv_pool_pages  # noqa: E402
from modelspec.spec import PRESETS, load_model_spec  # noqa: E402
from tests.model_parity import NEW_TOKENS, PROMPTS, greedy_paged, hf_greedy, hf_logits, randomize  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, tie_word_embeddings=False, qk_rope_head_dim=16, qk_nope_head_dim=16,
              v_head_dim=24, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
              first_k_dense_replace=1)
VARIANTS = {
    "v2-lite": dict(kv_lora_rank=48, q_lora_rank=None, topk_method="greedy"),
    "v2": dict(kv_lora_rank=32, q_lora_rank=40, topk_method="group_limited_greedy", n_group=4, topk_group=2,
               routed_scaling_factor=1.5),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def deepseek(request, tmp_path_factory):
    config = transformers.DeepseekV2Config(**COMMON, **VARIANTS[request.param])
    torch.manual_seed(0)
    hf = transformers.DeepseekV2ForCausalLM(config).eval()
    randomize(hf)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True, max_shard_size="40KB")
    spec = load_model_spec(str(folder))
    return hf, load_hf_checkpoint(folder, spec, jnp.float32), spec


def test_deepseek_v2_spec_reads_mla_and_routing(deepseek):
    _, model, spec = deepseek
    assert spec.architecture == "deepseek_v2" and spec.is_mla and spec.head_dim == spec.qk_rope_head_dim == 16
    assert [spec.is_moe_layer(i) for i in range(2)] == [False, True] and spec.num_shared_experts == 1
    assert model.layers[1].mlp.shared is not None and model.layers[0].mlp.__class__.__name__ == "MLP"


def test_deepseek_v2_greedy_tokens_match_hf(deepseek):
    hf, model, spec = deepseek
    ours, prefill_logits = greedy_paged(model, spec, PROMPTS, NEW_TOKENS)
    np.testing.assert_allclose(prefill_logits, hf_logits(hf, PROMPTS[0]), atol=3e-4, rtol=3e-4)
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        assert tokens == hf_greedy(hf, prompt, NEW_TOKENS)


def test_the_pool_holds_one_latent_row_per_token(deepseek):
    _, _, spec = deepseek
    caches = init_kv_cache(spec, 10, 4)
    assert len(caches) == 2 and [c[0].shape for c in caches] == [(10, 4, 1, spec.kv_lora_rank + 16)] * 2
    assert all(len(c) == 1 for c in caches)  # the latent only: no per-head K or V
    assert kv_cache_bytes(spec, 10, 4) == planner_kv_bytes(spec, 10, 4, jnp.float32)


def test_an_mla_engine_pool_holds_the_tokens_the_planner_says():
    spec = PRESETS["tiny-mla"]
    config = EngineConfig(model="tiny-mla", kv_cache_memory=3 * 2**20, page_size=16, max_model_len=512)
    built = build_model_and_cache(config, spec)
    pages = kv_pool_pages(spec, 3 * 2**20, 16, "fp32")
    assert built.num_pages == pages and built.kv_caches[0][0].shape == (pages, 16, 1, 64)
    allocated = sum(a.nbytes for layer in built.kv_caches for a in layer)
    assert allocated == pages * 16 * kv_bytes_per_token(spec, "fp32")
    # 2 layers x 64 floats a token: 512 bytes, where per-head K and V of 4 heads x 32 would take 2048.
    assert kv_bytes_per_token(spec, "fp32") == 2 * 64 * 4


@pytest.mark.parametrize("preset", ["tiny-mla", "tiny-moe"])
def test_engine_serves_the_synthetic_presets_as_the_model_decodes(preset):
    """`LLM` on the MLA and MoE presets (runner, scheduler, chunked prefill, the backend chosen at start-up) gives
    the tokens of the model run directly through the paged pool."""
    llm = LLM(preset, max_num_seqs=4, max_num_batched_tokens=64, chunk_size=32, page_size=16,
              kv_cache_memory=2**20, max_model_len=256, token_buckets=(8, 64), seq_buckets=(4,), warmup=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    spec = PRESETS[preset]
    direct, _ = greedy_paged(LlamaForCausalLM(spec, jnp.float32, rngs=nnx.Rngs(0)), spec, PROMPTS, 10)
    assert [o.outputs[0].token_ids for o in outs] == direct


def test_mla_refuses_tensor_parallelism_in_one_line():
    with pytest.raises(ValueError, match="does not support MLA"):
        check_tp(PRESETS["tiny-mla"], 2)
    check_tp(PRESETS["tiny-moe"], 2)  # MoE is tensor parallel (tests/test_model_moe.py)
