"""The few-row matmul kernel (jaxserve/kernels/gpu/matvec.py), run in Pallas' interpreter on the CPU against jnp:
bfloat16, float32, int8 and fp8 weights, 1/3/8/16 rows, K and N on and off the tiles, with and without a K split;
what it refuses and why; its tiles; and the kernel lowered for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.gpu.matvec import MatvecTiles, matvec, matvec_refusal, matvec_supports, matvec_tiles
from jaxserve.model.quantize import quantize_fp8, quantize_int8

SMALL = MatvecTiles(block_n=32, block_k=32, split_k=1)  # small tiles: several of them on small shapes
SPLIT = MatvecTiles(block_n=32, block_k=16, split_k=4)


def weights(rng: np.random.Generator, k: int, n: int, kind: str) -> tuple[jax.Array, jax.Array | None, np.ndarray]:
    """(W as the kernel takes it, its scales or None, the float64 matrix it stands for)."""
    w = rng.standard_normal((k, n), dtype=np.float32) * k**-0.5
    if kind in ("int8", "fp8"):
        qw = (quantize_int8 if kind == "int8" else quantize_fp8)(jnp.asarray(w))
        return qw.q, qw.scale, np.asarray(qw.dequantize(jnp.float32), np.float64)
    dtype = jnp.dtype(kind)
    w = jnp.asarray(w, dtype)
    return w, None, np.asarray(w.astype(jnp.float32), np.float64)


@functools.cache
def kernel(tiles: MatvecTiles):
    return jax.jit(functools.partial(matvec, tiles=tiles, interpret=True))


# (W kind, x dtype, tolerance): bf16 outputs round to a few bf16 ulps; float32 to float32's.
# Every kind in one split; in a K split (partials summed by XLA) the three a GPU serves with.
KINDS = [("bfloat16", jnp.bfloat16, 2e-2), ("float32", jnp.float32, 1e-5), ("int8", jnp.bfloat16, 2e-2),
         ("fp8", jnp.bfloat16, 2e-2), ("int8", jnp.float32, 1e-5)]
CASES = ([(kind, x, tol, SMALL) for kind, x, tol in KINDS]
         + [(kind, x, tol, SPLIT) for kind, x, tol in KINDS if x == jnp.bfloat16])


@pytest.mark.parametrize(("kind", "x_dtype", "tol", "tiles"), CASES)
def test_matches_jnp(kind, x_dtype, tol, tiles):
    """Rows 1 and 16 with K and N on the tiles (64 x 96), rows 3 and 8 off them (40 x 70): y = x @ W (W the
    values the codes stand for), compared with float64."""
    rng = np.random.default_rng(0)
    for (k, n), row_counts in (((64, 96), (1, 16)), ((40, 70), (3, 8))):
        w, scales, want_w = weights(rng, k, n, kind)
        for rows in row_counts:
            x = jnp.asarray(rng.standard_normal((rows, k), dtype=np.float32), x_dtype)
            y = kernel(tiles)(x, w, scales)
            assert y.dtype == x_dtype and y.shape == (rows, n)
            want = np.asarray(x.astype(jnp.float32), np.float64) @ want_w
            np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), want, atol=tol, rtol=tol,
                                       err_msg=f"{kind} {rows}x{k}x{n}")


def test_default_tiles_match_jnp_on_a_layer_shape():
    """The tiles `matvec_tiles` picks (a K split here) on a projection shaped like synthetic-1b's down projection,
    scaled down: int8 codes against XLA's dot of the dequantized weight."""
    rng = np.random.default_rng(1)
    w, scales, want_w = weights(rng, 1024, 256, "int8")
    tiles = matvec_tiles(1024, 256, w.dtype)
    assert tiles.split_k > 1
    x = jnp.asarray(rng.standard_normal((2, 1024), dtype=np.float32), jnp.bfloat16)
    y = kernel(tiles)(x, w, scales)
    want = np.asarray(x.astype(jnp.float32)) @ want_w
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), want, atol=2e-2, rtol=2e-2)


def test_refusals_say_why():
    assert matvec_supports(1, 2048, 3072, jnp.bfloat16, jnp.int8)
    assert matvec_supports(16, 2048, 3072, jnp.bfloat16, jnp.float8_e4m3fn, compute_capability=9.0)
    assert "1 to 16 rows" in matvec_refusal(17, 64, 64, jnp.bfloat16, jnp.bfloat16)
    assert "1 to 16 rows" in matvec_refusal(0, 64, 64, jnp.bfloat16, jnp.bfloat16)
    assert "8.9" in matvec_refusal(1, 64, 64, jnp.bfloat16, jnp.float8_e4m3fn, compute_capability=8.0)
    assert "x's dtype" in matvec_refusal(1, 64, 64, jnp.bfloat16, jnp.float32)
    assert "float32, bfloat16" in matvec_refusal(1, 64, 64, jnp.int8, jnp.int8)
    assert "non-empty" in matvec_refusal(1, 0, 64, jnp.bfloat16, jnp.bfloat16)
    x, w = jnp.zeros((2, 64), jnp.bfloat16), jnp.zeros((64, 32), jnp.int8)
    with pytest.raises(ValueError, match="need their scales"):
        matvec(x, w, interpret=True)
    with pytest.raises(ValueError, match="only codes take scales"):
        matvec(x, w.astype(jnp.bfloat16), jnp.ones(32), interpret=True)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        matvec(jnp.zeros((32, 64), jnp.bfloat16), w, jnp.ones(32), interpret=True)


def test_tiles_fill_the_device():
    # synthetic-1b's projections in bf16: few N tiles get a K split, many do not; every split keeps 2+ K tiles.
    for k, n, dtype in ((2048, 3072, jnp.bfloat16), (2048, 2048, jnp.bfloat16), (8192, 2048, jnp.int8),
                        (2048, 16384, jnp.float8_e4m3fn), (4096, 28672, jnp.bfloat16), (100, 10, jnp.float32)):
        t = matvec_tiles(k, n, dtype)
        programs = -(-n // t.block_n) * t.split_k
        assert programs >= 264 or t.split_k == 16 or k <= 2 * t.block_k * t.split_k, (k, n, t)
        assert t.split_k == 1 or k >= 2 * t.block_k * t.split_k, (k, n, t)
        assert t.block_n * t.block_k * jnp.dtype(dtype).itemsize <= 16384, (k, n, t)
    assert matvec_tiles(2048, 16384, jnp.bfloat16) == MatvecTiles(128, 64, 4)  # 128 tiles: x 2 is 256 < 264
    assert matvec_tiles(2048, 3072, jnp.bfloat16).split_k == 16  # 24 tiles x 16 = 384
    assert matvec_tiles(8192, 2048, jnp.int8) == MatvecTiles(128, 128, 16)


@pytest.mark.parametrize("kind", ["bfloat16", "fp8"])
def test_the_kernel_lowers_for_cuda_without_a_gpu(kind):
    rng = np.random.default_rng(0)
    w, scales, _ = weights(rng, 256, 384, kind)
    x = jnp.zeros((8, 256), jnp.bfloat16)
    try:
        text = jax.jit(matvec).trace(x, w, scales).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # a jax without the Triton/CUDA lowering rules
        pytest.skip(f"jax cannot lower Pallas for CUDA here: {type(e).__name__}: {e}")
    assert "__gpu$xla.gpu.triton" in text and "stablehlo.while" not in text
