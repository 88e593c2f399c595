"""Mixture-of-experts models against HF transformers, and the grouped expert compute on its own.

Mixtral (top-2 of 8, weights renormalized) and Qwen3-MoE (top-4 of 16 small experts, q/k norm, a dense layer
named by `mlp_only_layers`) are written by HF with random weights, loaded by our loader (HF's own layout, and the
one-tensor-per-expert layout the published checkpoints use) and decoded greedily through the paged cache: the
tokens must equal HF's `generate`. The grouped compute must equal a dense sum over all experts and must not read
the experts no token chose (their weights are NaN there).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.core.batch import trash_prefill
from jaxserve.kernels.cpu import library as cpu_kernels
from jaxserve.kernels.cpu import matmul as cpu_matmul
from jaxserve.kernels.cpu.kernel_plan import KernelPlan
from jaxserve.model.moe import grouped_experts, route, tile_rows
from jaxserve.platform import kernel_choice
from tests.conftest import TINY_ENGINE_ARGS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.model.weights import load_hf_checkpoint  # noqa: E402
from modelspec.spec import load_model_spec  # noqa: E402
from tests.model_parity import NEW_TOKENS, PROMPTS, greedy_paged, hf_greedy, hf_logits, randomize  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False)


def _fused_layout(hf, src, dst) -> None:
    """Write the model as transformers 5 holds it in memory: each layer's experts fused into
    `experts.gate_up_proj` [E, 2I, hidden] and `experts.down_proj` [E, hidden, I] (`save_pretrained` splits them
    back into one tensor per expert, the published layout)."""
    dst.mkdir()
    tensors = {name: t.detach().numpy().copy() for name, t in hf.state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())


def _names(folder) -> set[str]:
    return {name for file in folder.glob("*.safetensors") for name in load_file(str(file))}


def _build(tmp_path_factory, name: str, config):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize(hf)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder, safe_serialization=True, max_shard_size="40KB")
    return hf, folder


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    config = transformers.MixtralConfig(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, **COMMON)
    return _build(tmp_path_factory, "mixtral", config)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    config = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=16,
                                         num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1],
                                         head_dim=32, **COMMON)
    return _build(tmp_path_factory, "qwen3_moe", config)


def test_mixtral_spec_and_tokens_match_hf(mixtral):
    hf, folder = mixtral
    spec = load_model_spec(str(folder))
    assert (spec.architecture, spec.num_experts, spec.num_experts_per_tok, spec.norm_topk_prob) == ("mixtral", 8, 2,
                                                                                                     True)
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in _names(folder)  # the hub checkpoints' names
    model = load_hf_checkpoint(folder, spec, jnp.float32)
    ours, prefill_logits = greedy_paged(model, spec, PROMPTS, NEW_TOKENS)
    np.testing.assert_allclose(prefill_logits, hf_logits(hf, PROMPTS[0]), atol=2e-4, rtol=2e-4)
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        assert tokens == hf_greedy(hf, prompt, NEW_TOKENS)


def test_qwen3_moe_tokens_match_hf_in_both_layouts(qwen3_moe, tmp_path):
    hf, folder = qwen3_moe
    spec = load_model_spec(str(folder))
    assert spec.architecture == "qwen3_moe" and spec.qk_norm and spec.mlp_only_layers == (1,)
    assert [spec.is_moe_layer(i) for i in range(2)] == [True, False] and spec.num_moe_layers == 1
    assert "model.layers.0.mlp.experts.15.gate_proj.weight" in _names(folder)  # one tensor per expert
    _fused_layout(hf, folder, tmp_path / "fused")
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    for source in (folder, tmp_path / "fused"):
        model = load_hf_checkpoint(source, spec, jnp.float32)
        assert model.layers[1].mlp.__class__.__name__ == "MLP"
        ours, _ = greedy_paged(model, spec, PROMPTS, NEW_TOKENS)
        assert ours == expected, source


def test_mixtral_loads_transformers_5_fused_experts(mixtral, tmp_path):
    hf, folder = mixtral
    _fused_layout(hf, folder, tmp_path / "fused")
    spec = load_model_spec(str(folder))
    ours, _ = greedy_paged(load_hf_checkpoint(tmp_path / "fused", spec, jnp.float32), spec, PROMPTS[:1], 8)
    assert ours[0] == hf_greedy(hf, PROMPTS[0], 8)


def _dense_reference(x, ids, weights, gate_up, down):
    """Every expert on every token, masked by the routing: what grouped compute must equal."""
    gu = jnp.einsum("th,ehci->etci", x, gate_up)
    y = jnp.einsum("eti,eih->eth", jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1], down)
    mask = jnp.zeros((x.shape[0], gate_up.shape[0])).at[jnp.arange(x.shape[0])[:, None], ids].add(weights)
    return jnp.einsum("te,eth->th", mask, y)


def _grouped_kernel():
    return cpu_matmul.cpu_grouped_matmul if cpu_kernels.available() else pytest.skip("no CPU kernels here")


@pytest.mark.parametrize("in_kernel", [False, True], ids=["xla-loop", "grouped-kernel"])
@pytest.mark.parametrize("tokens", [1, 5, 64, 200])
def test_grouped_experts_equal_the_dense_sum_and_skip_unused_experts(tokens, in_kernel):
    e, k, hidden, inter = 16, 2, 32, 24
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32))
    gate_up = rng.standard_normal((e, hidden, 2, inter), np.float32) * hidden**-0.5
    down = rng.standard_normal((e, inter, hidden), np.float32) * inter**-0.5
    used = rng.choice(e, size=min(e, 6), replace=False)  # tokens route among 6 experts only
    ids = np.stack([rng.choice(used, size=k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = jnp.asarray(rng.random((tokens, k), np.float32))
    expected = _dense_reference(x, jnp.asarray(ids), weights, jnp.asarray(gate_up), jnp.asarray(down))
    unused = np.setdiff1d(np.arange(e), used)
    gate_up[unused], down[unused] = np.nan, np.nan  # read by a dense formulation, never by the grouped one
    grouped = _grouped_kernel() if in_kernel else None  # 200 tokens: tiles of 64 rows, several for one expert
    got = jax.jit(lambda *a: grouped_experts(*a, grouped=grouped))(x, jnp.asarray(ids), weights,
                                                                    jnp.asarray(gate_up), jnp.asarray(down))
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("in_kernel", [False, True], ids=["xla-loop", "grouped-kernel"])
@pytest.mark.parametrize("tokens,real", [(8, 5), (192, 130)])
def test_a_steps_padding_rows_run_no_expert(tokens, real, in_kernel):
    """A step padded to its bucket: the real rows come out as without the padding and the padding rows as zeros;
    the padding's experts (NaN here) are never read, though every padding row chose them."""
    e, k, hidden, inter = 8, 2, 32, 24
    rng = np.random.default_rng(real)
    x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32))
    gate_up = rng.standard_normal((e, hidden, 2, inter), np.float32) * hidden**-0.5
    down = rng.standard_normal((e, inter, hidden), np.float32) * inter**-0.5
    ids = np.stack([rng.choice(6, size=k, replace=False) for _ in range(tokens)]).astype(np.int32)
    ids[real:] = (6, 7)  # the padding (one token repeated) all routes to experts 6 and 7 ...
    gate_up[6:], down[6:] = np.nan, np.nan  # ... which no real row chose
    weights = jnp.asarray(rng.random((tokens, k), np.float32))
    args = (jnp.asarray(ids), weights, jnp.asarray(gate_up), jnp.asarray(down))
    grouped = _grouped_kernel() if in_kernel else None
    got = jax.jit(lambda x, *a: grouped_experts(x, *a, grouped=grouped, num_tokens=jnp.int32(real)))(x, *args)
    alone = jax.jit(lambda x, *a: grouped_experts(x, *a, grouped=grouped))(x[:real], *(a[:real] for a in args[:2]),
                                                                           *args[2:])
    np.testing.assert_allclose(np.asarray(got[:real]), np.asarray(alone), atol=1e-5, rtol=1e-5)
    assert not np.any(np.asarray(got[real:]))


def test_an_moe_engine_runs_its_experts_in_the_grouped_kernel_at_its_plans_step_sizes(monkeypatch):
    _grouped_kernel()
    prompts = ["The experts", "Mixture of", "abc"]
    params = SamplingParams(max_tokens=12, temperature=0.0)

    def run(moe_rows: set[int]) -> tuple[list[list[int]], str]:
        plan = KernelPlan(cpu_kernels.isa() or "", frozenset(), frozenset(), frozenset(moe_rows))
        monkeypatch.setattr(kernel_choice, "choose", lambda *args, **kwargs: plan)
        llm = LLM(model="tiny-moe", **TINY_ENGINE_ARGS)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        runner = llm.engine.runner
        batch = trash_prefill(4, runner.page_size, runner.max_num_seqs, runner.pages_per_seq * runner.page_size)
        hlo = runner.lower_forward(batch, 4).as_text()
        return tokens, hlo

    in_kernel, hlo = run(set(range(1, 65)))
    assert cpu_matmul.TARGET_GROUPED in hlo
    in_xla, hlo = run(set())
    assert cpu_matmul.TARGET_GROUPED not in hlo
    assert in_kernel == in_xla


def test_tiles_per_step_follow_distinct_experts():
    """A decode step's tile holds all of one expert's rows, so tiles run == distinct experts chosen."""
    assert tile_rows(1, 2, 8) == 1 and tile_rows(64, 8, 128) == 64
    assert tile_rows(2048, 2, 8) == 256 and tile_rows(100, 2, 64) == 64


def test_route_matches_hf_routers():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((5, 8), np.float32))
    w, ids = route(logits, 2, norm_topk_prob=True)
    probs = torch.softmax(torch.tensor(np.asarray(logits)), -1)
    tv, ti = torch.topk(probs, 2, -1)
    np.testing.assert_array_equal(np.asarray(ids), ti.numpy())
    np.testing.assert_allclose(np.asarray(w), (tv / tv.sum(-1, keepdim=True)).numpy(), rtol=1e-6)
    w, ids = route(logits, 2, norm_topk_prob=False, scaling=2.5, topk_method="group_limited_greedy", n_group=4,
                   topk_group=1)
    groups = probs.view(5, 4, 2).max(-1).values.argmax(-1)
    assert (np.asarray(ids) // 2 == groups.numpy()[:, None]).all()  # both picks inside the best group
    np.testing.assert_allclose(np.asarray(w), 2.5 * torch.gather(probs, 1, torch.tensor(np.asarray(ids))).numpy(),
                               rtol=1e-6)


def test_moe_under_tensor_parallelism_gives_one_devices_tokens():
    """tiny-moe at TP 1, 2 and 4 (8 fake CPU devices): each expert's intermediate axis split, same tokens."""
    driver = Path(__file__).with_name("moe_tp_driver.py")
    proc = subprocess.run([sys.executable, str(driver), "1", "2", "4"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["2"]["tokens"] == runs["1"]["tokens"] and runs["4"]["tokens"] == runs["1"]["tokens"]
    assert runs["1"]["expert_shape"] == [8, 64, 2, 64]
    assert runs["2"]["expert_shard_shape"] == [8, 64, 2, 32] and runs["4"]["expert_shard_shape"] == [8, 64, 2, 16]
