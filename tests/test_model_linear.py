"""The model's projections: the same products whichever CPU matmul (jaxserve's kernel, Eigen or YNNPACK) a step's
row count gets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.cpu import library as cpu_kernels
from jaxserve.kernels.cpu import matmul as cpu_matmul
from jaxserve.model.llama import RMSNorm, linear
from jaxserve.platform.kernel_choice import CPU_KERNEL_ROUTE, CPU_XLA_ROUTE
from jaxserve.platform.policy import CPU_SEPARATE_DOTS_ABOVE, CPU_SEPARATE_DOTS_OPTIONS

CPU_EIGEN_MAX_ROWS = CPU_XLA_ROUTE.transposed_rows[1]


@pytest.mark.parametrize("rows", [1, 2, CPU_EIGEN_MAX_ROWS, CPU_EIGEN_MAX_ROWS + 8, 64])
def test_linear_is_a_matmul_over_the_leading_axis(rows: int) -> None:
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 64), dtype=np.float32)
    w = rng.standard_normal((64, 2, 48), dtype=np.float32)  # a fused projection, as gate_up is
    out = jax.jit(linear)(jnp.asarray(x), jnp.asarray(w))
    assert out.shape == (rows, 2, 48)
    np.testing.assert_allclose(np.asarray(out), np.einsum("th,hki->tki", x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not cpu_kernels.available(), reason="jaxserve's CPU kernels are not built here")
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 24, cpu_matmul.MAX_ROWS])
@pytest.mark.parametrize("inputs", [64, 37])  # whole row blocks of w (16 rows a sweep), and a short last block
def test_the_matmul_kernel_is_a_matmul(rows: int, inputs: int) -> None:
    """Up to MAX_ROWS rows (two passes of rows beyond 16, split evenly), output columns in 16-float vectors split
    between threads, and a fused [in, 2, out] weight read as one matrix."""
    rng = np.random.default_rng(rows * 100 + inputs)
    x = rng.standard_normal((rows, inputs), dtype=np.float32)
    w = rng.standard_normal((inputs, 2, 48), dtype=np.float32)
    assert cpu_matmul.supports(jnp.asarray(x), jnp.asarray(w))
    out = jax.jit(cpu_matmul.cpu_matmul)(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(out), np.einsum("th,hki->tki", x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not cpu_kernels.available(), reason="jaxserve's CPU kernels are not built here")
@pytest.mark.parametrize("inputs", [37, 64, 130, 600])
@pytest.mark.parametrize("row_parts", [0, 1, 2, 4])
def test_one_row_sums_the_weights_in_parts(inputs: int, row_parts: int) -> None:
    """One row of x takes w's rows in contiguous parts of at least 32 (37, 64: one and two parts; 130: four of 32
    or 33 rows, not whole groups of eight; 600: the most, 16 by default or the plan's `row_parts`) and adds the
    parts' partial outputs."""
    rng = np.random.default_rng(inputs)
    x = rng.standard_normal((1, inputs), dtype=np.float32)
    w = rng.standard_normal((inputs, 80), dtype=np.float32)
    out = jax.jit(lambda x, w: cpu_matmul.cpu_matmul(x, w, row_parts))(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(out), x @ w, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not cpu_kernels.available(), reason="jaxserve's CPU kernels are not built here")
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 16, 17, cpu_matmul.MAX_ROWS])
@pytest.mark.parametrize("w_rows", [40, 44, 1000])
def test_the_transposed_matmul_kernel_is_a_matmul(rows: int, w_rows: int) -> None:
    """x @ w^T for a tied LM head: one row of x against each row of w whole; 2-8 rows of x four at a time and a
    remainder against rows of w four at a time, or, for 9-16 rows of x, x^T against rows of w eight at a time (40:
    five groups, split between threads; 44, not a
    multiple of eight: four at a time), in bands of w's rows, four a thread (1000 rows: bands of 31-32 groups)."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 64), dtype=np.float32)
    w = rng.standard_normal((w_rows, 64), dtype=np.float32)
    assert cpu_matmul.supports_nt(jnp.asarray(x), jnp.asarray(w))
    out = jax.jit(cpu_matmul.cpu_matmul_nt)(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(out), x @ w.T, rtol=1e-5, atol=1e-4)
    assert not cpu_matmul.supports_nt(jnp.asarray(x), jnp.ones((42, 64), jnp.float32))  # N not in fours


@pytest.mark.skipif(not cpu_kernels.available(), reason="jaxserve's CPU kernels are not built here")
@pytest.mark.parametrize("k", [16, 48, 80, 768])
def test_one_row_against_the_transposed_matrix_reads_each_row_whole(k: int) -> None:
    """One row of x (a decode's tied head) reads each row of w as one dot product, four vectors at a time and the
    rest one at a time: inputs of 1, 3, 5 and 48 vectors."""
    rng = np.random.default_rng(k)
    x = rng.standard_normal((1, k), dtype=np.float32)
    w = rng.standard_normal((1000, k), dtype=np.float32)
    out = jax.jit(cpu_matmul.cpu_matmul_nt)(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(out), x @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not cpu_kernels.available(), reason="jaxserve's CPU kernels are not built here")
def test_linear_gives_the_kernel_few_rows_and_whole_vectors_only() -> None:
    w = jnp.ones((64, 96), jnp.float32)

    def hlo(rows: int, w: jax.Array = w) -> str:
        return jax.jit(lambda x, w: linear(x, w, CPU_KERNEL_ROUTE)).lower(jnp.ones((rows, 64)), w).as_text()

    assert cpu_matmul.TARGET in hlo(1) and cpu_matmul.TARGET in hlo(cpu_matmul.MAX_ROWS)
    assert cpu_matmul.TARGET not in hlo(cpu_matmul.MAX_ROWS + 1)
    assert cpu_matmul.TARGET not in hlo(4, jnp.ones((64, 40), jnp.float32))  # 40 columns: not whole vectors
    assert cpu_matmul.TARGET not in jax.jit(linear).lower(jnp.ones((4, 64)), w).as_text()  # not asked for


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the routing is a CPU one")
def test_a_few_rows_are_kept_away_from_ynnpack_on_cpu() -> None:
    w = jnp.ones((256, 512), jnp.float32)

    def compiled(rows: int) -> str:
        f = jax.jit(lambda x, w: linear(x, w, CPU_XLA_ROUTE))
        return f.lower(jnp.ones((rows, 256), jnp.float32), w).compile().as_text()

    if "__ynn_fusion" not in compiled(64):
        pytest.skip("this XLA does not hand dots to YNNPACK")
    assert "__ynn_fusion" not in compiled(4)
    assert "__ynn_fusion" not in compiled(CPU_EIGEN_MAX_ROWS)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the option is a CPU one")
def test_wide_steps_keep_each_norm_out_of_the_next_dot_on_cpu() -> None:
    """Buckets above CPU_SEPARATE_DOTS_ABOVE compile with every dot a YNNPACK call of its own, so an RMSNorm is
    never recomputed inside the projection after it (XLA fuses the two from ~4096 rows, at ~60% of the speed)."""
    norm = RMSNorm(768, 1e-5, jnp.float32)
    w = jnp.ones((768, 2, 2048), jnp.float32)
    x = jnp.ones((2 * CPU_SEPARATE_DOTS_ABOVE, 768), jnp.float32)

    def step(x: jax.Array, w: jax.Array) -> jax.Array:
        return linear(norm(x), w)

    text = jax.jit(step, compiler_options=dict(CPU_SEPARATE_DOTS_OPTIONS)).lower(x, w).compile().as_text()
    if "__ynn_fusion" not in text:
        pytest.skip("this XLA does not hand dots to YNNPACK")
    computations = text.split("\n\n")
    assert any(" dot(" in c for c in computations)
    assert not any(" dot(" in c and " reduce(" in c for c in computations)
