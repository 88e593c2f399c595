"""Split-KV (flash-decoding) decode attention, run in Pallas' interpreter on the CPU, against a dense float64
numpy attention and the jnp reference backend: decode-only and mixed steps, GQA groups 1/4/8, pages of 16 and 32
tokens, contexts on and off the KV-block and split boundaries, padded decode rows and empty sequences, 1/2/4
splits, float32, bfloat16, int8 and fp8 pools; how the split count is chosen; and the kernel lowered for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import kv_quant
from jaxserve.kernels.gpu.split_kv_decode import (
    SplitKvAttention,
    choose_splits,
    combine_splits,
    split_kv_decode_attention,
)
from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.model.attention.reference import ACCELERATOR_TUNING

# Small fixed buckets so each configuration compiles once: 16 token rows, 8 sequences, contexts up to 128 keys in
# 32-key blocks (two 16-token pages or one 32-token page).
T_PAD, S_PAD, KV_HEADS, D, KV_BLOCK, MAX_CTX = 16, 8, 2, 32, 32, 128
SCALE = D**-0.5
# Decode contexts: one key, one short of / on / one past a block, a split's worth, off any boundary, the longest.
DECODES = [1, 31, 32, 33, 64, 100, 128]
MIXED = ([32, 7, 100], [(9, 15), (3, 60), (1, 0)])  # decodes, then (q_len, prior context) chunks: 16 tokens


def build_step(rng: np.random.Generator, decode_ctx: list[int], prefill: list[tuple[int, int]],
               page_size: int) -> dict[str, np.ndarray]:
    """Host metadata of a step padded to (T_PAD tokens, S_PAD sequences): decodes, then prefill chunks, then
    empty sequences; pages drawn at random (page 0, the trash page, left out); the table's unused entries 0."""
    q_lens = [1] * len(decode_ctx) + [q for q, _ in prefill]
    kv_lens = list(decode_ctx) + [q + c for q, c in prefill]
    n = len(q_lens)
    cu = np.full(S_PAD + 1, sum(q_lens), np.int32)
    cu[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv = np.zeros(S_PAD, np.int32)
    kv[:n] = kv_lens
    pages = rng.permutation(np.arange(1, num_pages(page_size)))
    table = np.zeros((S_PAD, MAX_CTX // page_size), np.int32)
    used = 0
    for s, length in enumerate(kv_lens):
        need = -(-length // page_size)
        table[s, :need] = pages[used : used + need]
        used += need
    return dict(slot_mapping=np.zeros(T_PAD, np.int32), cu_q_lens=cu, kv_lens=kv, page_table=table,
                num_seqs=np.int32(n), num_decodes=np.int32(len(decode_ctx)))


def num_pages(page_size: int) -> int:
    return 1 + S_PAD * MAX_CTX // page_size


def dense_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, m: dict[str, np.ndarray]) -> np.ndarray:
    """Per-sequence causal attention in float64 over the values the pools stand for, KV heads repeated."""
    t, h, d = q.shape
    page_size, kvh = k.shape[1], k.shape[2]
    out = np.zeros((t, h, d))
    for s in range(int(m["num_seqs"])):
        lo, hi, kv_len = m["cu_q_lens"][s], m["cu_q_lens"][s + 1], m["kv_lens"][s]
        idx = np.arange(kv_len)
        slots = m["page_table"][s, idx // page_size] * page_size + idx % page_size
        ks = np.repeat(k.reshape(-1, kvh, d)[slots].astype(np.float64), h // kvh, axis=1)
        vs = np.repeat(v.reshape(-1, kvh, d)[slots].astype(np.float64), h // kvh, axis=1)
        scores = np.einsum("qhd,khd->hqk", q[lo:hi].astype(np.float64), ks) * SCALE
        q_pos = kv_len - (hi - lo) + np.arange(hi - lo)
        scores = np.where(idx[None, None, :] <= q_pos[None, :, None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[lo:hi] = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), vs)
    return out


def inputs(rng: np.random.Generator, group: int, page_size: int, dtype) -> tuple[np.ndarray, ...]:
    """q, k, v as float32 numpy, already rounded to `dtype` so the float64 reference sees the kernel's inputs."""
    shape = (num_pages(page_size), page_size, KV_HEADS, D)
    arrays = (rng.standard_normal((T_PAD, KV_HEADS * group, D), dtype=np.float32),
              rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32))
    return tuple(np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in arrays)


def quantized_pools(k: np.ndarray, v: np.ndarray, kind: str) -> tuple[kv_quant.QuantizedPool, ...]:
    """Quantized K and V pools of `kind` as the step's scatter writes them, and the values they stand for."""
    pools = tuple(kv_quant.QuantizedPool(*kv_quant.quantize(jnp.asarray(x), kind), jnp.dtype(jnp.float32))
                  for x in (k, v))
    values = tuple(np.asarray(kv_quant.dequantize(p.codes, p.scales)) for p in pools)
    return pools, values


def as_meta(m: dict[str, np.ndarray]) -> AttentionMetadata:
    return AttentionMetadata(**{name: jnp.asarray(x) for name, x in m.items()})


@functools.cache
def decode_fn(splits: int):
    return jax.jit(functools.partial(split_kv_decode_attention, scale=SCALE, splits=splits, kv_block=KV_BLOCK,
                                     interpret=True))


def run_decodes(splits: int, q, k, v, m: dict[str, np.ndarray], dtype) -> np.ndarray:
    """The split kernel on the step's first S_PAD rows (every row a decode row or padding)."""
    k, v = (x if isinstance(x, kv_quant.QuantizedPool) else jnp.asarray(x, dtype) for x in (k, v))
    out = decode_fn(splits)(jnp.asarray(q[:S_PAD], dtype), k, v, jnp.asarray(m["page_table"]),
                            jnp.asarray(m["kv_lens"]), jnp.asarray(m["num_decodes"]))
    assert out.dtype == dtype and out.shape == (S_PAD, q.shape[1], D)
    return np.asarray(out.astype(jnp.float32))


# (group, page size, splits): every group, page size and split count at least once in float32.
FLOAT32_CONFIGS = [(1, 16, 1), (4, 32, 2), (8, 16, 4), (4, 16, 4)]


@pytest.mark.parametrize(("group", "page_size", "splits"), FLOAT32_CONFIGS)
def test_decodes_match_dense_attention_float32(group, page_size, splits):
    """Full and partly padded decode batches (contexts on and off block and split boundaries, some shorter than
    the split count in blocks) and an empty step, through one compiled kernel."""
    rng = np.random.default_rng(group * 100 + page_size + splits)
    q, k, v = inputs(rng, group, page_size, jnp.float32)
    for decodes in (DECODES, DECODES[:3], [MAX_CTX, 1], []):
        m = build_step(rng, decodes, [], page_size)
        out = run_decodes(splits, q, k, v, m, jnp.float32)
        want = dense_reference(q, k, v, m)[:S_PAD]
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5, err_msg=str(decodes))
        assert np.all(out[len(decodes):] == 0), "padded decode rows must come back as zeros"


def test_decodes_match_dense_attention_bfloat16():
    rng = np.random.default_rng(5)
    q, k, v = inputs(rng, 8, 32, jnp.bfloat16)
    m = build_step(rng, DECODES, [], 32)
    out = run_decodes(4, q, k, v, m, jnp.bfloat16)
    # Probabilities go to bf16 before P @ V and the output is bf16: a few bf16 ulps.
    np.testing.assert_allclose(out, dense_reference(q, k, v, m)[:S_PAD], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(("kind", "splits"), [("int8", 2), ("fp8", 4)])
def test_quantized_pools_are_read_as_codes(kind, splits):
    """int8 / fp8 pools: the kernel, converting codes in registers, equals dense attention over the values the
    codes stand for (and the jnp reference, which dequantizes at its gather)."""
    rng = np.random.default_rng(11)
    q, k, v = inputs(rng, 4, 16, jnp.float32)
    (kp, vp), (kd, vd) = quantized_pools(k, v, kind)
    m = build_step(rng, DECODES[1:], [], 16)
    out = run_decodes(splits, q, kp, vp, m, jnp.float32)
    np.testing.assert_allclose(out, dense_reference(q, kd, vd, m)[:S_PAD], atol=1e-4, rtol=1e-4)
    ref = jax.jit(functools.partial(ACCELERATOR_TUNING, scale=SCALE))(jnp.asarray(q), kp, vp, as_meta(m))
    np.testing.assert_allclose(out, np.asarray(ref)[:S_PAD], atol=1e-4, rtol=1e-4)


def test_a_mixed_step_keeps_one_ragged_call_for_the_rest():
    """Decodes through the split kernel, prefill chunks (one a single first token) through the ragged kernel:
    the whole step equals dense attention and the jnp reference; padded rows are zeros."""
    rng = np.random.default_rng(2)
    q, k, v = inputs(rng, 4, 16, jnp.float32)
    m = build_step(rng, *MIXED, 16)
    backend = SplitKvAttention(kv_block=KV_BLOCK, prefill_kv_block=KV_BLOCK, interpret=True)
    out = np.asarray(jax.jit(functools.partial(backend, scale=SCALE))(q, k, v, as_meta(m)))
    np.testing.assert_allclose(out, dense_reference(q, k, v, m), atol=2e-5, rtol=2e-5)
    ref = jax.jit(functools.partial(ACCELERATOR_TUNING, scale=SCALE))(q, k, v, as_meta(m))
    np.testing.assert_allclose(out, np.asarray(ref), atol=2e-5, rtol=2e-5)
    assert np.all(out[int(m["cu_q_lens"][-1]):] == 0)


def test_decode_only_variant_and_the_one_token_step():
    """The decode-only variant skips the ragged call; a one-token step (a decode, a first prompt token, or
    nothing) is decode-only by construction."""
    rng = np.random.default_rng(4)
    q, k, v = inputs(rng, 4, 16, jnp.float32)
    decode_only = jax.jit(functools.partial(SplitKvAttention(kv_block=KV_BLOCK, decode_only=True, interpret=True),
                                            scale=SCALE))
    m = build_step(rng, DECODES, [], 16)
    out = np.asarray(decode_only(q, k, v, as_meta(m)))
    np.testing.assert_allclose(out, dense_reference(q, k, v, m), atol=2e-5, rtol=2e-5)
    one = jax.jit(functools.partial(SplitKvAttention(kv_block=KV_BLOCK, interpret=True), scale=SCALE))
    for decodes, prefills in (([77], []), ([], [(1, 0)]), ([], [(1, 20)]), ([], [])):
        m = build_step(rng, decodes, prefills, 16)
        m["slot_mapping"] = m["slot_mapping"][:1]
        out = np.asarray(one(q[:1], k, v, as_meta(m)))
        np.testing.assert_allclose(out, dense_reference(q[:1], k, v, m), atol=2e-5, rtol=2e-5)


def test_combine_merges_partials_as_one_softmax():
    """Partials of the same scores cut in two, merged, equal the softmax of all of them; all-empty rows are 0."""
    rng = np.random.default_rng(0)
    s = rng.standard_normal((3, 10)).astype(np.float32)  # base-2 logits of 3 rows over 10 keys
    vals = rng.standard_normal((10, 4)).astype(np.float32)
    parts = []
    for cut in (slice(0, 6), slice(6, 10)):
        m = s[:, cut].max(1)
        p = np.exp2(s[:, cut] - m[:, None])
        parts.append((p @ vals[cut], m, p.sum(1)))
    acc, m, den = (jnp.stack([p[i] for p in parts]) for i in range(3))
    p = np.exp2(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(np.asarray(combine_splits(acc, m, den)), (p / p.sum(1, keepdims=True)) @ vals,
                               rtol=1e-5, atol=1e-6)
    empty = combine_splits(jnp.zeros((2, 3, 4)), jnp.full((2, 3), jnp.finfo(jnp.float32).min), jnp.zeros((2, 3)))
    assert np.all(np.asarray(empty) == 0)


def test_the_split_count_fills_the_device():
    # One 1k-context decode of a 1B model (8 KV heads): 2 x 132 programs wanted, 16 blocks of 64 keys cap it.
    assert choose_splits(8, 1, 1024, 16) == 16
    assert choose_splits(8, 1, 4096, 16) == 64  # 264 / 8 = 33 -> 64 (a power of two), 64 blocks allow it
    assert choose_splits(8, 8, 1024, 16) == 8  # 8 x 8 x 8 = 512 >= 264
    assert choose_splits(8, 64, 8192, 16) == 1  # the grid is full without splitting
    assert choose_splits(8, 1, 16, 16) == 1  # one block: nothing to split
    assert choose_splits(8, 1, 1 << 20, 16) == 64  # capped: the partials are written and re-read
    assert choose_splits(8, 1, 1024, 16, num_sms=16) == 4  # a small GPU: 32 / 8 programs
    backend = SplitKvAttention()
    assert backend.splits_for(1, 8, (1, 64), 16) == 16 and backend.splits_for(2048, 8, (8, 64), 16) == 8


def lower_for_cuda(fn, *args) -> str:
    """StableHLO of `fn(*args)` lowered for CUDA on this (GPU-less) machine, or a skip saying why not."""
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # a jax without the Triton/CUDA lowering rules
        pytest.skip(f"jax cannot lower Pallas for CUDA here: {type(e).__name__}: {e}")


@pytest.mark.parametrize("kind", ["bfloat16", "fp8"])
def test_the_step_lowers_for_cuda_without_a_gpu(kind):
    """Two Triton custom calls (split decode and ragged rest) and no loop outside them: no host round trip."""
    rng = np.random.default_rng(0)
    q, k, v = inputs(rng, 4, 16, jnp.bfloat16)
    if kind == "fp8":
        (k, v), _ = quantized_pools(k, v, "fp8")
        k, v = (kv_quant.QuantizedPool(p.codes, p.scales, jnp.dtype(jnp.bfloat16)) for p in (k, v))
    else:
        k, v = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    meta = as_meta(build_step(rng, *MIXED, 16))
    text = lower_for_cuda(functools.partial(SplitKvAttention(), scale=SCALE), jnp.asarray(q, jnp.bfloat16), k, v,
                          meta)
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert "stablehlo.while" not in text
