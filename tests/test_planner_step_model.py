"""The step model: per-operation FLOPs and bytes, KV sizes, MoE experts, and the roofline floor."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelspec.memory import kv_bytes_per_token, plan_memory
from modelspec.moe_tiles import expected_tiles, tile_rows
from modelspec.spec import PRESETS
from planner.hardware import CATALOG
from planner.search import tp_options
from planner.step_model import (
    batch_shape,
    decode_shape,
    expected_experts,
    op_costs,
    prefill_shape,
    step_time,
    step_time_shape,
    weight_time_per_device,
)

H100 = CATALOG["h100-sxm"]
L8B = PRESETS["llama-3.1-8b"]


def test_seed_example_70b_bandwidth_floor_is_44_ms():
    # 140 GB of bf16 weights + 8 GB of KV read at 3.35 TB/s: 148e9 / 3.35e12 = 44.2 ms per token.
    spec = PRESETS["llama-3.1-70b"]
    kv_tokens = 8e9 / kv_bytes_per_token(spec, "bf16")  # one sequence holding 8 GB of KV cache
    t = step_time(spec, H100, decode_context_lens=[int(kv_tokens)])
    assert t.roofline_s == pytest.approx(148e9 / 3.35e12, rel=0.02)
    assert t.total_s > t.roofline_s  # efficiencies and overheads only add


def _ops(shape, **kw):
    return {op.name: op for op in op_costs(L8B, shape, **kw)}


def test_llama31_8b_decode_ops_match_hand_calculation():
    ctx = 1000
    ops = _ops(decode_shape(1, ctx))
    h, q, kv, hd, inter, vocab = 4096, 32, 8, 128, 14336, 128256
    assert ops["qkv_proj"].flops == 2 * h * (q + 2 * kv) * hd  # 50.3 MFLOP
    assert ops["qkv_proj"].weight_bytes == h * (q + 2 * kv) * hd * 2
    assert ops["o_proj"].flops == 2 * q * hd * h
    assert ops["mlp"].flops == 2 * 3 * h * inter  # 352 MFLOP
    assert ops["mlp"].weight_bytes == 3 * h * inter * 2
    assert ops["attention"].flops == 4 * q * hd * (ctx + 1)  # QK^T and PV over ctx + the new token
    # Reads ctx + 1 cached entries (K and V, 8 heads of 128, bf16) and writes the new one.
    assert ops["attention"].kv_bytes == (ctx + 2) * 2 * kv * hd * 2
    assert ops["lm_head"].flops == 2 * h * vocab
    assert ops["qkv_proj"].count == ops["mlp"].count == 32
    total_weights = sum(op.weight_bytes * op.count for op in ops.values())
    # Every weight is streamed once, except the input embedding table: only the token's row is gathered.
    assert total_weights == (L8B.param_count() - vocab * h + h) * 2


def test_llama31_8b_prefill_attention_is_causal():
    ops = _ops(prefill_shape(512, 0))
    assert ops["attention"].flops == 4 * 32 * 128 * (512 * 513 / 2)
    assert ops["mlp"].flops == 512 * 2 * 3 * 4096 * 14336
    chunk2 = _ops(prefill_shape(512, 512))  # second chunk attends to the first one too
    assert chunk2["attention"].flops == 4 * 32 * 128 * 512 * (512 + 513 / 2)


def test_tp_splits_flops_and_adds_two_allreduces_per_layer():
    one, two = _ops(decode_shape(8, 100)), _ops(decode_shape(8, 100), tp=2)
    assert two["mlp"].flops == one["mlp"].flops / 2
    assert two["allreduce_attn"].collectives == two["allreduce_mlp"].collectives == 1
    assert one["allreduce_attn"].collectives == 0
    t = step_time(L8B, H100, [100] * 8, tp=2)
    assert t.comm_s >= 2 * 32 * H100.allreduce_latency_s


def test_kv_bytes_per_token_gqa_mla_and_replication():
    assert kv_bytes_per_token(L8B, "bf16") == 32 * 2 * 8 * 128 * 2  # 128 KiB: GQA, 8 KV heads
    assert kv_bytes_per_token(L8B, "bf16", tp=8) == kv_bytes_per_token(L8B, "bf16") / 8
    # tp=16 > 8 KV heads: each device still holds one whole KV head (replicated), not half of one.
    assert kv_bytes_per_token(L8B, "bf16", tp=16) == kv_bytes_per_token(L8B, "bf16", tp=8)
    ds = PRESETS["deepseek-v3"]  # MLA: latent 512 + rope key 64 per layer, the same on every TP rank
    assert kv_bytes_per_token(ds, "bf16") == 61 * (512 + 64) * 2
    assert kv_bytes_per_token(ds, "bf16", tp=8) == kv_bytes_per_token(ds, "bf16")
    # One-byte codes plus one float32 scale per token per KV head (the runtime's kv_quant pools).
    assert kv_bytes_per_token(L8B, "fp8") == kv_bytes_per_token(L8B, "int8") == 32 * 2 * 8 * (128 + 4)
    assert kv_bytes_per_token(ds, "fp8") == 61 * (512 + 64 + 4)


def test_expected_moe_experts_is_k_for_one_token_and_tends_to_all():
    assert expected_experts(8, 2, 1) == pytest.approx(2)
    assert expected_experts(256, 8, 1) == pytest.approx(8)
    assert expected_experts(256, 8, 10_000) == pytest.approx(256, rel=1e-6)
    values = [expected_experts(256, 8, t) for t in (1, 4, 16, 64, 256)]
    assert values == sorted(values)
    # Mixtral at batch 1 reads 2 of 8 experts; at batch 64 nearly all 8.
    mix = PRESETS["mixtral-8x7b"]
    one = {op.name: op for op in op_costs(mix, decode_shape(1, 100))}["experts"]
    many = {op.name: op for op in op_costs(mix, decode_shape(64, 100))}["experts"]
    assert one.weight_bytes == pytest.approx(2 * mix.expert_params() * 2)
    assert many.weight_bytes == pytest.approx(8 * mix.expert_params() * 2, rel=1e-3)


def test_prefill_sized_moe_steps_price_the_runtimes_padded_tiles():
    # Exact E[ceil(c / R)] for c ~ Binomial(T, k/E), against the planner's normal approximation.
    def exact(t: int, k: int, e: int) -> float:
        p, r = k / e, tile_rows(t, k, e)
        logs = [math.lgamma(t + 1) - math.lgamma(c + 1) - math.lgamma(t - c + 1) + c * math.log(p)
                + (t - c) * math.log1p(-p) for c in range(t + 1)]
        return e * sum(math.exp(lp) * math.ceil(c / r) for c, lp in enumerate(logs))

    for t, k, e in [(256, 2, 8), (512, 2, 8), (3072, 2, 8), (1024, 8, 128)]:
        assert expected_tiles(t, k, e) == pytest.approx(exact(t, k, e), rel=0.01)
    assert expected_tiles(16, 2, 8) == pytest.approx(expected_experts(8, 2, 16))  # decode: a tile per expert
    mix = PRESETS["mixtral-8x7b"]

    def expert_flops(shape) -> float:
        return {op.name: op for op in op_costs(mix, shape)}["experts"].flops

    per_row = 2 * 3 * mix.hidden_size * mix.moe_intermediate_size
    assert expert_flops(decode_shape(16, 100)) == pytest.approx(16 * 2 * per_row)  # padding skipped
    prefill = prefill_shape(256)
    # 256 tokens x 2 experts = 512 rows, laid out in ~11.7 tiles of 64: about 1.47x the rows computed.
    assert expert_flops(prefill) == pytest.approx(exact(256, 2, 8) * 64 * per_row, rel=0.01)


def test_deepseek_shared_expert_always_read():
    ds = PRESETS["deepseek-v3"]
    experts = {op.name: op for op in op_costs(ds, decode_shape(1, 10))}["experts"]
    assert experts.weight_bytes == pytest.approx((8 + 1) * ds.expert_params() * 2)


def test_bottleneck_names_the_binding_term():
    assert step_time(L8B, H100, [512]).bottleneck == "weights"  # batch-1 decode streams weights
    assert step_time(L8B, H100, prefill_chunks=[(8192, 0)]).bottleneck == "compute"
    assert "binds" in step_time(L8B, H100, [512]).explain()


def test_gemv_speedup_reads_only_one_row_matmuls_faster():
    """A device whose one-row kernel streams weights 1.5x faster: a lone decode's weight term shrinks by that
    much (all its matmuls have one row), two decodes' does not change."""
    import dataclasses

    fast = dataclasses.replace(H100, coefficients=dataclasses.replace(H100.coefficients, gemv_speedup=1.5))
    one, two = decode_shape(1, 512), decode_shape(2, 512)
    assert step_time_shape(L8B, fast, one).weight_s == pytest.approx(  # norm weights and one embedding row aside
        step_time_shape(L8B, H100, one).weight_s / 1.5, rel=1e-3)
    assert step_time_shape(L8B, fast, two).weight_s == step_time_shape(L8B, H100, two).weight_s
    # A lone prefill's lm_head has one row, its projections many: only the former speeds up.
    chunk = prefill_shape(256)
    assert step_time_shape(L8B, H100, chunk).weight_s > step_time_shape(L8B, fast, chunk).weight_s > (
        step_time_shape(L8B, H100, chunk).weight_s / 1.5)


def test_batch_shape_adds_decodes_and_chunks():
    s = batch_shape([10, 20], [(5, 3)])
    assert (s.num_decode, s.num_prefill, s.num_tokens, s.num_seqs) == (2, 1, 7, 3)
    assert s.attn_pairs == 11 + 21 + 5 * (3 + 3)


models = st.sampled_from(["llama-3.1-8b", "llama-2-7b", "mixtral-8x7b", "deepseek-v3", "qwen2.5-7b", "small"])
hardware = st.sampled_from(["h100-sxm", "a100-80g", "cpu", "tpu-v5e"])


@settings(max_examples=40, deadline=None)
@given(models, hardware, st.integers(1, 300), st.integers(0, 8000), st.integers(1, 300), st.integers(1, 4000))
def test_step_time_never_falls_as_batch_or_context_grows(model, hw, batch, ctx, more, longer):
    spec, dev = PRESETS[model], CATALOG[hw]
    t = step_time_shape(spec, dev, decode_shape(batch, ctx)).total_s
    assert step_time_shape(spec, dev, decode_shape(batch + more, ctx)).total_s >= t
    assert step_time_shape(spec, dev, decode_shape(batch, ctx + longer)).total_s >= t


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(["llama-3.1-8b", "llama-3.1-70b", "mixtral-8x7b", "deepseek-v3", "qwen2.5-72b", "tiny"]))
def test_more_tp_never_raises_per_device_weight_time(model):
    spec = PRESETS[model]
    times = [weight_time_per_device(spec, H100, tp) for tp in tp_options(spec, 64)]
    assert all(b <= a for a, b in zip(times, times[1:], strict=False))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["llama-3.1-8b", "llama-2-13b", "mistral-7b"]), st.integers(1, 60000), st.integers(1, 60000))
def test_kv_capacity_falls_as_context_grows(model, ctx, extra):
    mem = plan_memory(PRESETS[model], H100.memory_bytes)
    assert mem.max_concurrency(ctx + extra) <= mem.max_concurrency(ctx)
    assert mem.max_concurrency(ctx) * ctx <= mem.kv_capacity_tokens + mem.page_size * mem.max_concurrency(ctx)


def test_a_quantized_kv_read_counts_each_rows_scale_beside_its_codes():
    def kv_read(kv_dtype: str) -> float:
        return sum(op.kv_bytes * op.count for op in op_costs(L8B, decode_shape(8, 1000), kv_dtype=kv_dtype))

    hd = L8B.head_dim  # 128: one float32 scale per 128 one-byte codes
    assert kv_read("int8") / kv_read("bf16") == pytest.approx((hd + 4) / (2 * hd))
    assert kv_read("fp8") == pytest.approx(kv_read("int8"))


def test_a_padded_moe_step_prices_its_real_tokens_experts_in_its_buckets_tiles():
    """The runtime routes only a step's real tokens; the bucket sets the tile size. 130 tokens at 192 rows: tiles
    of 64 (192 x 2 / 8 = 48 rows an expert, rounded up), filled by 130 tokens' 260 rows."""
    mix = PRESETS["mixtral-8x7b"]
    shape = prefill_shape(130)

    def experts(padded: int):
        return {op.name: op for op in op_costs(mix, shape, padded_tokens=padded)}["experts"]

    per_row = 2 * 3 * mix.hidden_size * mix.moe_intermediate_size
    assert experts(192).flops == pytest.approx(expected_tiles(130, 2, 8, padded_tokens=192) * 64 * per_row)
    assert expected_tiles(130, 2, 8, padded_tokens=192) < expected_tiles(192, 2, 8)
    # decode sizes: one tile per expert the real tokens touch, whatever the bucket
    assert expected_tiles(5, 2, 8, padded_tokens=6) == pytest.approx(expected_experts(8, 2, 5))
    assert experts(192).weight_bytes == pytest.approx(expected_experts(8, 2, 130) * 3 * mix.hidden_size
                                                      * mix.moe_intermediate_size * 2)


def test_the_overlapped_loop_hides_each_steps_host_work_behind_the_device():
    """With --async-scheduling a step takes the longer of its host work and its device work, not their sum."""
    import dataclasses as dc

    from modelspec.spec import load_model_spec
    from planner.hardware import load_hardware
    from planner.step_model import decode_shape, step_time_shape

    spec, hw = load_model_spec("llama-3.1-8b"), load_hardware("h200")
    c = dc.replace(hw.coefficients, dispatch_overhead_s=400e-6)
    shape = decode_shape(8, 1024)
    sync = step_time_shape(spec, hw, shape, coefficients=c).total_s
    overlapped = step_time_shape(spec, hw, shape, coefficients=c, overlapped=True).total_s
    assert overlapped == pytest.approx(sync - 400e-6)
    tiny_device = dc.replace(c, dispatch_overhead_s=10.0)  # host work longer than the whole step: it sets the pace
    assert step_time_shape(spec, hw, shape, coefficients=tiny_device, overlapped=True).total_s == pytest.approx(10.0)
