"""`--kv-cache-dtype int8|fp8`: KV pages stored as one-byte codes with one float32 scale per token per KV head,
quantized by the step's scatter and dequantized inside attention, through every backend; the pool's page count is
the planner's figure, scales included; perplexity and greedy tokens stay close to the float pool's."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from jaxserve import LLM
from jaxserve.cli.main import cli
from jaxserve.config.engine import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.tokenizer import load_tokenizer
from jaxserve.kernels import kv_quant
from jaxserve.kernels.gpu.ragged_paged_attention import PallasAttention
from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.measure.eval.agreement import greedy_agreement
from jaxserve.measure.eval.perplexity import perplexity
from jaxserve.measure.eval.windows import read_eval_text
from jaxserve.model.attention.cpu_kernel import CpuKernelAttention
from jaxserve.model.attention.paged_attention import write_kv
from jaxserve.model.attention.reference import ReferenceAttention
from jaxserve.platform.attention_choice import select_backend
from jaxserve.runner.model_builder import build_model_and_cache
from modelspec.memory import kv_bytes_per_token, kv_pool_pages
from modelspec.spec import load_model_spec
from tests.model_parity import randomize
from tests.test_paged_attention import NUM_PAGES, PAGE_SIZE, T_PAD, D, build_batch, dense_reference
from tests.test_pallas_attention import lower_for_cuda

KINDS = ("int8", "fp8")
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=128, chunk_size=128, page_size=16,
              kv_cache_memory=4 * 2**20, token_buckets=(16, 32, 64, 128), warmup=False)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("kind", KINDS)
def test_codes_and_scales_round_trip_within_one_rounding_step_per_row(kind):
    x = jax.random.normal(jax.random.key(0), (64, 3, 32)) * jnp.arange(1, 4)[None, :, None]  # heads of 3 ranges
    codes, scales = kv_quant.quantize(x, kind)
    assert codes.dtype == kv_quant.CODE_DTYPES[kind] and scales.shape == (64, 3) and scales.dtype == jnp.float32
    amax = jnp.max(jnp.abs(x), axis=-1)
    np.testing.assert_allclose(scales * kv_quant.CODE_MAX[kind], amax, rtol=1e-6)  # each row's max|x| -> code_max
    err = jnp.abs(kv_quant.dequantize(codes, scales) - x)
    # int8: half a step; e4m3: 3 mantissa bits, so half an ulp is 1/16 of the value (finer below 2^-6: subnormals)
    bound = scales[..., None] / 2 if kind == "int8" else jnp.abs(x) / 16 + scales[..., None] * 2.0**-10
    assert bool(jnp.all(err <= bound + 1e-6))
    zero_codes, zero_scales = kv_quant.quantize(jnp.zeros((2, 1, 8)), kind)
    assert zero_scales.tolist() == [[1.0], [1.0]] and not bool(jnp.any(zero_codes.astype(jnp.float32)))


@pytest.mark.parametrize("kind", KINDS)
def test_write_kv_quantizes_into_the_slots_and_a_one_token_write_too(kind):
    shape = (6, 4, 2, 16)
    k_pool, v_pool = (kv_quant.empty_pool(shape, kind, jnp.float32) for _ in range(2))
    k, v = (jax.random.normal(jax.random.key(i), (3, 2, 16)) for i in (1, 2))
    slots = jnp.array([5, 9, 22])
    k_pool, v_pool = jax.jit(write_kv)(k_pool, v_pool, k, v, slots)
    for pool, x in ((k_pool, k), (v_pool, v)):
        assert isinstance(pool, kv_quant.QuantizedPool) and pool.codes.dtype == kv_quant.CODE_DTYPES[kind]
        got = kv_quant.rows(pool, jnp.arange(6)).reshape(24, 2, 16)[slots]
        np.testing.assert_allclose(got, x, atol=float(jnp.max(jnp.abs(x))) / 14)
    one_k, _ = jax.jit(write_kv)(k_pool, v_pool, k[:1] * 3, v[:1], jnp.array([13]))
    np.testing.assert_allclose(kv_quant.rows(one_k, 3)[1], k[0] * 3, atol=3 * float(jnp.max(jnp.abs(k[0]))) / 14)
    np.testing.assert_array_equal(kv_quant.rows(one_k, 1)[1], kv_quant.rows(k_pool, 1)[1])  # other slots kept


def _backends() -> list:
    """Every backend that reads a quantized pool on this machine (the Pallas kernel interpreted)."""
    out = [ReferenceAttention(decode_mode="loop", kv_block=8, q_block_sizes=(8, 4), decode_kv_block=16,
                              decode_tail_block=4),
           ReferenceAttention(decode_mode="batched", kv_block=8, q_block_sizes=(8, 4), decode_kv_block=16)]
    for name, backend in (("cpu", CpuKernelAttention()), ("pallas", PallasAttention(interpret=True))):
        try:
            select_backend(name, "cpu", jnp.float32, D, PAGE_SIZE, kv_cache_dtype="int8")
        except ValueError:
            continue
        out.append(backend)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", _backends(), ids=lambda b: f"{b.name}-{getattr(b, 'decode_mode', '')}")
@pytest.mark.parametrize("d", [D, 64])
def test_attention_over_codes_equals_attention_over_their_dequantized_values(backend, kind, d):
    """Decodes, chunks after a history and a chunk long enough for the C++ kernel's tiles."""
    rng = np.random.default_rng(7)
    m = build_batch(rng, [4, 17, 30], [(11, 0), (9, 13), (20, 5)])
    heads, kv_heads = 4, 2
    q = rng.standard_normal((T_PAD, heads, d), dtype=np.float32)
    k, v = (rng.standard_normal((NUM_PAGES, PAGE_SIZE, kv_heads, d), dtype=np.float32) for _ in range(2))
    pools = [kv_quant.QuantizedPool(*kv_quant.quantize(jnp.asarray(x), kind), jnp.dtype(jnp.float32)) for x in (k, v)]
    meta = AttentionMetadata(**{name: jnp.asarray(a) for name, a in m.items()})
    out = np.asarray(jax.jit(lambda q, kp, vp: backend(q, kp, vp, meta, d**-0.5))(jnp.asarray(q), *pools))
    values = [np.asarray(kv_quant.dequantize(p.codes, p.scales)) for p in pools]
    np.testing.assert_allclose(out, dense_reference(q, *values, m, d**-0.5), atol=1e-4, rtol=1e-4)
    assert np.all(out[int(m["cu_q_lens"][-1]):] == 0)


def test_the_flag_the_config_and_their_one_line_refusals():
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"  # vLLM's other name
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="disaggregate"):
        EngineConfig(kv_cache_dtype="int8", disaggregate=True)
    res = CliRunner().invoke(cli, ["generate", "--model", "tiny", "--kv-cache-dtype", "int4", "--prompt", "x"])
    assert res.exit_code == 2 and "int4" in res.output and "Traceback" not in res.output


def test_auto_picks_a_backend_that_reads_the_pool_and_explicit_ones_say_why_not():
    for kind in ("auto", *KINDS):
        backend = select_backend("auto", "cpu", jnp.float32, 64, 16, kv_cache_dtype=kind)
        assert select_backend(backend.name, "cpu", jnp.float32, 64, 16, kv_cache_dtype=kind) == backend
        gpu = select_backend("auto", "gpu", jnp.bfloat16, 64, 16, kv_cache_dtype=kind)
        assert gpu.name in ("pallas-split", "pallas", "reference")  # split-KV decode: a GPU's default
    for name in ("cpu", "pallas"):
        try:
            select_backend(name, "cpu", jnp.float32, 64, 16, kv_cache_dtype="fp8")
        except ValueError as e:
            assert f"'{name}'" in str(e) and "fp8" in str(e) and "\n" not in str(e)


@pytest.mark.parametrize("model", ["tiny", "bard", "tiny-mla"])
def test_the_pool_holds_the_planners_pages_and_bytes_for_every_kv_dtype(model):
    """One KV budget: pages == `kv_pool_pages` of the KV dtype, and the pool's arrays (codes and scales) take
    exactly pages x page_size x `kv_bytes_per_token`; against float32 that is 4 x width / (width + 4) the pages,
    width a cached row's (head_dim; MLA: its latent row)."""
    spec, budget, page = load_model_spec(model), 3 * 2**20, 16
    pages = {}
    for kind, name in (("auto", "fp32"), ("int8", "int8"), ("fp8", "fp8")):
        built = build_model_and_cache(EngineConfig(model=model, kv_cache_memory=budget, kv_cache_dtype=kind), spec)
        assert built.num_pages == kv_pool_pages(spec, budget, page, name) > 1
        nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(built.kv_caches))
        assert nbytes == built.num_pages * page * kv_bytes_per_token(spec, name) <= budget
        pages[kind] = built.num_pages
    d = spec.kv_lora_rank + spec.qk_rope_head_dim if spec.is_mla else spec.head_dim
    for kind in KINDS:
        assert pages[kind] / pages["auto"] == pytest.approx(4 * d / (d + 4), rel=0.01)


@pytest.fixture(scope="module")
def bard_fp32():
    return LLM("bard", **ENGINE)


@pytest.mark.parametrize(("kind", "floor"), [("int8", 0.8), ("fp8", 0.65)])
def test_bard_perplexity_within_two_percent_and_greedy_tokens_agree(bard_fp32, kind, floor):
    ids = load_tokenizer("bard").encode(read_eval_text("bard", "held-out"), add_special_tokens=False)[:3000]
    quant = LLM("bard", kv_cache_dtype=kind, **ENGINE)
    assert quant.engine.runner.kv_caches[0][0].kind == kind
    ppl_f, ppl_q = perplexity(bard_fp32.engine, ids, 200).perplexity, perplexity(quant.engine, ids, 200).perplexity
    assert ppl_q / ppl_f - 1 < 0.02, (ppl_q, ppl_f)
    prompts = [ids[i:i + 16] for i in range(0, 8 * 64, 64)]
    assert greedy_agreement(bard_fp32, quant, prompts) >= floor  # measured 0.883 / 0.746 (docs/quantization.md)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny random-weight Llama written by HF transformers (the parity tests' scale of weights, head_dim 16)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    randomize(hf)
    folder = tmp_path_factory.mktemp("hf-llama")
    hf.save_pretrained(folder, safe_serialization=True)
    return str(folder)


@pytest.mark.parametrize(("kind", "floor"), [("int8", 0.85), ("fp8", 0.8)])
def test_a_random_hf_checkpoints_greedy_tokens_agree(hf_folder, kind, floor):
    base, quant = LLM(hf_folder, **ENGINE), LLM(hf_folder, kv_cache_dtype=kind, **ENGINE)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 96, 12)] for i in range(8)]
    assert greedy_agreement(base, quant, prompts) >= floor  # measured 0.973 / 0.926 (docs/quantization.md)


def test_prefix_cache_hits_and_preemption_read_the_same_quantized_pages():
    """A cached prefix's pages are reused with their scales (same tokens as a cold run), and a pool too small
    for every request at once preempts and recomputes into quantized pages again."""
    prompt = list(range(5, 5 + 40))
    llm = LLM("tiny", kv_cache_dtype="int8", **ENGINE)
    cold = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    hits = llm.engine.counters["prefix_cache_hits"]
    warm = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert llm.engine.counters["prefix_cache_hits"] > hits and warm == cold
    small = LLM("tiny", kv_cache_dtype="int8", **dict(ENGINE, kv_cache_memory=kv_pool_bytes(13)))
    prompts = [list(range(3 + i, 3 + i + 40)) for i in range(4)]
    outs = small.generate(prompts, GREEDY)
    assert small.engine.counters["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize(("kind", "floor"), [("int8", 0.9), ("fp8", 0.2)])
def test_an_mla_engine_keeps_its_latent_rows_quantized_and_decodes_as_the_float_pool(kind, floor):
    """One scale per latent row [c | k_pe]; the backend reads the pool as both K and V (attention/latent.py)."""
    args = dict(max_num_seqs=4, max_num_batched_tokens=64, chunk_size=32, page_size=16, kv_cache_memory=2**20,
                max_model_len=256, token_buckets=(8, 64), seq_buckets=(4,))
    base, quant = LLM("tiny-mla", **args), LLM("tiny-mla", kv_cache_dtype=kind, **args)
    pool = quant.engine.runner.kv_caches[0][0]
    assert pool.kind == kind and pool.scales.shape == pool.shape[:3] and pool.shape[2] == 1
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 200, 20)] for i in range(4)]
    # Random weights decode through near ties, which e4m3's 3 mantissa bits tip: measured 0.984 / 0.305.
    assert greedy_agreement(base, quant, prompts) >= floor


def kv_pool_bytes(pages: int) -> int:
    """A budget of `pages` int8 pages of `tiny` (trash page included)."""
    return int(pages * 16 * kv_bytes_per_token(load_model_spec("tiny"), "int8"))


@pytest.mark.parametrize("kind", KINDS)
def test_the_pallas_kernel_over_quantized_pages_lowers_for_cuda_without_a_gpu(kind):
    """The codes, their scales and the bf16 queries in one Triton call, no loop outside it."""
    rng = np.random.default_rng(0)
    m = build_batch(rng, [4, 17], [(11, 0), (9, 13)])
    q = jnp.asarray(rng.standard_normal((T_PAD, 4, D)), jnp.bfloat16)
    pools = [kv_quant.QuantizedPool(*kv_quant.quantize(jnp.asarray(rng.standard_normal((NUM_PAGES, PAGE_SIZE, 2, D))),
                                                       kind), jnp.dtype(jnp.bfloat16)) for _ in range(2)]
    meta = AttentionMetadata(**{name: jnp.asarray(a) for name, a in m.items()})
    text = lower_for_cuda(lambda q, k, v: PallasAttention()(q, k, v, meta, D**-0.5), q, *pools)
    assert "__gpu$xla.gpu.triton" in text and "stablehlo.while" not in text


TP_SCRIPT = """
from jaxserve import LLM, SamplingParams
args = dict(max_num_seqs=4, max_num_batched_tokens=64, chunk_size=32, page_size=16, kv_cache_memory=2**20,
            max_model_len=256, token_buckets=(8, 64), seq_buckets=(4,), kv_cache_dtype="int8")
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
prompts = [list(range(3 + i, 30 + i)) for i in range(3)]
tokens = {}
for tp in (1, 2, 4):
    llm = LLM("tiny", tensor_parallel_size=tp, **args)
    pool = llm.engine.runner.kv_caches[0][0]
    assert tuple(pool.scales.sharding.spec) == tuple(pool.codes.sharding.spec)[:3] == (None, None, "tp")
    tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
assert tokens[1] == tokens[2] == tokens[4], tokens
print("ok")
"""


def test_tensor_parallel_engines_shard_codes_and_scales_on_kv_heads_and_decode_alike():
    """tp 2 splits `tiny`'s 2 KV heads, tp 4 replicates them; the greedy tokens are tp 1's."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    out = subprocess.run([sys.executable, "-c", TP_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
