"""Attention backends: chosen once at start-up (flag, config, selection rules), the same tokens whichever runs, and
an accelerator step whose StableHLO holds no loop bounded by a device-side value."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from cli_helpers import engine_config_from_flags

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import ATTENTION_BACKENDS, EngineConfig
from jaxserve.core.batch import empty_batch
from jaxserve.kernels.gpu.ragged_paged_attention import PallasAttention
from jaxserve.kernels.gpu.split_kv_decode import SplitKvAttention
from jaxserve.model.attention.cpu_kernel import CpuKernelAttention
from jaxserve.model.attention.reference import ACCELERATOR_TUNING, CPU_TUNING
from jaxserve.platform.attention_choice import finest_chunk, select_backend
from tests.conftest import TINY_ENGINE_ARGS
from tests.hlo_checks import dynamic_while_loops, host_round_trips


def test_auto_picks_per_platform_dtype_and_shape():
    f32, bf16 = jnp.float32, jnp.bfloat16
    assert select_backend("auto", "cpu", f32, 64, 16) == CpuKernelAttention()
    assert select_backend("auto", "cpu", f32, 64, 16, cpu_kernels=False) == CPU_TUNING
    assert select_backend("auto", "cpu", bf16, 64, 16) == CPU_TUNING  # the C++ kernel is float32 only
    assert select_backend("auto", "gpu", bf16, 64, 16) == SplitKvAttention()  # decodes split over the KV
    assert select_backend("auto", "gpu", bf16, 80, 16) == ACCELERATOR_TUNING  # not a power of two
    assert select_backend("auto", "gpu", bf16, 128, 16, num_devices=2) == SplitKvAttention()  # the policy shards it
    assert select_backend("auto", "tpu", bf16, 128, 16) == ACCELERATOR_TUNING
    assert select_backend("reference", "gpu", bf16, 128, 16) == ACCELERATOR_TUNING
    assert select_backend("reference", "cpu", f32, 64, 16) == CPU_TUNING
    assert select_backend("pallas", "cpu", f32, 64, 16) == PallasAttention(interpret=True)
    assert select_backend("pallas-split", "cpu", f32, 64, 16) == SplitKvAttention(interpret=True)


@pytest.mark.parametrize(("name", "platform", "dtype", "head_dim", "message"), [
    ("cpu", "gpu", jnp.bfloat16, 64, "runs on a CPU"),
    ("cpu", "cpu", jnp.bfloat16, 64, "needs float32"),
    ("pallas", "tpu", jnp.bfloat16, 64, "NVIDIA GPUs"),
    ("pallas", "gpu", jnp.bfloat16, 96, "power-of-two head_dim"),
    ("flash", "gpu", jnp.bfloat16, 64, "must be one of"),
])
def test_an_explicit_choice_that_cannot_run_is_refused(name, platform, dtype, head_dim, message):
    with pytest.raises(ValueError, match=message):
        select_backend(name, platform, dtype, head_dim, 16)


def test_the_config_and_the_flag():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")
    for argv, expected in (([], "auto"), (["--attention-backend", "pallas"], "pallas")):
        config, output = engine_config_from_flags(*argv)
        assert config is not None, output
        assert config.attention_backend == expected
    assert engine_config_from_flags("--attention-backend", "flash")[0] is None
    assert set(ATTENTION_BACKENDS) == {"auto", "reference", "cpu", "pallas", "pallas-split"}
    assert finest_chunk(16) == min(CPU_TUNING.q_blocks)


def test_every_backend_gives_the_same_greedy_tokens():
    """`tiny` on this CPU: the C++ kernel (auto) and the Pallas kernel (interpreted; the jnp reference, slow to
    compile here, is compared with both in the attention tests), each recorded in the engine config; prompts
    long enough for several prefill chunks and KV blocks."""
    prompts = [list(range(3, 3 + n)) for n in (70, 9, 20)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    args = dict(TINY_ENGINE_ARGS, max_num_seqs=4, max_num_batched_tokens=32, chunk_size=32, token_buckets=(32,),
                seq_buckets=(4,), warmup=False)  # one compile of each step function
    tokens = {}
    for name in ("auto", "pallas"):
        llm = LLM(model="tiny", attention_backend=name, **args)
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.config.attention_backend == {"auto": "cpu"}.get(name, name)
        assert llm.engine.runner.ops.attention.name == llm.engine.config.attention_backend
    assert tokens["pallas"] == tokens["auto"]


def test_the_loop_detector_tells_static_from_dynamic_bounds():
    def f(x, n):
        x = jax.lax.fori_loop(0, 7, lambda i, c: c * 2, x)
        return jax.lax.fori_loop(0, n, lambda i, c: c + 1, x)

    text = jax.jit(f).trace(jnp.ones(3), 5).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.while") == 2 and len(dynamic_while_loops(text)) == 1


def lowered_step(runner, backend, num_tokens: int) -> str:
    """The runner's jitted forward body with `backend`, lowered for CUDA from shapes alone (no GPU here)."""
    # read when the body is traced, as at start-up
    runner.policy = dataclasses.replace(runner.policy, ops=dataclasses.replace(runner.ops, attention=backend))
    try:
        return runner.trace_forward(empty_batch(), num_tokens).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # a jax without the Triton/CUDA lowering rules
        pytest.skip(f"jax cannot lower the step for CUDA here: {type(e).__name__}: {e}")


@pytest.fixture(scope="module")
def xla_runner():
    """A `tiny` runner whose matmuls stay in XLA (the CPU kernels' custom calls have no CUDA lowering)."""
    return LLM(model="tiny", attention_backend="reference", cpu_kernels=False, **TINY_ENGINE_ARGS).engine.runner


@pytest.mark.parametrize("num_tokens", [1, 8, 128])  # the batch-1 decode, a decode batch, a prefill bucket
def test_the_accelerator_step_has_no_host_visible_loop(xla_runner, num_tokens):
    """With the Pallas backend the runner's whole forward (placeholders, embedding, every layer's scatter and
    attention, the norm, the logits rows) lowers for CUDA with no while loop at all; the jnp reference's
    accelerator tuning, lowered the same way, has loops bounded by device-side lengths (the round trips the
    kernel removes)."""
    runner = xla_runner
    pallas = lowered_step(runner, PallasAttention(), num_tokens)
    assert "__gpu$xla.gpu.triton" in pallas
    assert "stablehlo.while" not in pallas
    for split in (SplitKvAttention(), SplitKvAttention(decode_only=True)):  # the GPU default, and its decode step
        text = lowered_step(runner, split, num_tokens)
        assert "__gpu$xla.gpu.triton" in text and host_round_trips(text) == []
    assert dynamic_while_loops(lowered_step(runner, ACCELERATOR_TUNING, num_tokens))
