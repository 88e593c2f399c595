"""The GPU matmul route: few-row projections in the Pallas matmul at the row counts measured faster at start-up,
fp8 weights past them as an fp8 GEMM of per-token quantized activations. Run on a CPU (the kernel interpreted),
lowered for CUDA without a GPU, and the start-up choice with a fake timer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.model.layers import linear
from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.ops import XLA_MATMULS, MatmulRoute
from jaxserve.model.quantize import QUANTIZERS, fp8_matmul
from jaxserve.platform import gpu_matmul_choice
from modelspec.spec import PRESETS

MATVEC = MatmulRoute(matvec_rows=frozenset({1, 3}), matvec_interpret=True)


def _weights(k: int = 64, n: int = 80) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(k + n)
    return rng.standard_normal((3, k), np.float32), rng.standard_normal((k, 2, n // 2), np.float32) * k**-0.5


@pytest.mark.parametrize("method", [None, "int8", "fp8"])
def test_the_few_row_matmul_gives_xlas_product_at_its_row_counts(method):
    x, w = _weights()
    w = jnp.asarray(w) if method is None else QUANTIZERS[method](jnp.asarray(w))
    for rows in (1, 3):
        got = linear(jnp.asarray(x[:rows]), w, MATVEC)
        want = linear(jnp.asarray(x[:rows]), w, XLA_MATMULS)
        assert got.shape == want.shape == (rows, 2, 40)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=2e-3)


def test_the_route_sends_only_its_row_counts_to_the_kernel():
    x, w = _weights()

    def lowered(rows: int) -> str:
        traced = jax.jit(lambda x, w: linear(x, w, dataclasses.replace(MATVEC, matvec_interpret=False))).trace(
            jax.ShapeDtypeStruct((rows, 64), jnp.bfloat16), jax.ShapeDtypeStruct(w.shape, jnp.bfloat16))
        try:
            return traced.lower(lowering_platforms=("cuda",)).as_text()
        except Exception as e:  # a jax without the Triton lowering
            pytest.skip(f"jax cannot lower for CUDA here: {type(e).__name__}")

    assert "triton" in lowered(1) and "triton" not in lowered(2)


def test_fp8_activations_keep_the_product_within_fp8s_precision():
    x, w = _weights(128, 256)
    x = np.concatenate([x, 10 * x])  # rows of different magnitude: each keeps its own scale
    qw = QUANTIZERS["fp8"](jnp.asarray(w))
    got = np.asarray(fp8_matmul(jnp.asarray(x), qw))
    want = x @ np.asarray(qw.dequantize()).reshape(128, -1)
    rel = np.abs(got.reshape(6, -1) - want) / (np.abs(want).max(axis=1, keepdims=True))
    assert rel.max() < 0.08  # e4m3 keeps 3 mantissa bits on each side
    routed = linear(jnp.asarray(x), qw, MatmulRoute(fp8_activations=True))
    np.testing.assert_allclose(np.asarray(routed), got, rtol=1e-6)


def test_the_start_up_choice_keeps_the_faster_row_counts_and_caches_them(tmp_path):
    model = LlamaForCausalLM(PRESETS["tiny"], jnp.bfloat16, rngs=nnx.Rngs(0))
    seen = []

    def fake(kernel, xla, args, repeats):  # the kernel wins at one row, loses at eight
        rows = next(iter(args[0].values())).shape[0]
        seen.append(rows)
        return [1.0, 2.0] if rows == 1 else [3.0, 2.0]

    class Device:
        device_kind, compute_capability = "NVIDIA H200", "9.0"

    cache = tmp_path / "plan.json"
    assert gpu_matmul_choice.choose(model, (1, 8, 32), Device(), cache=cache, timer=fake) == {1}
    assert sorted(seen) == [1, 8]  # 32 rows: past the kernel's
    assert gpu_matmul_choice.choose(model, (1, 8, 32), Device(), cache=cache, timer=fake) == {1}
    assert sorted(seen) == [1, 8]  # the second start read the cache
    assert gpu_matmul_choice.fp8_tensor_cores(Device())
