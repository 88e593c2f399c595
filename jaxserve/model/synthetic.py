"""A synthetic preset's model: seeded random weights, drawn where they are cheapest.

Below `DEVICE_DRAW_PARAMS` the weights are numpy normals drawn on the host (`layers.normals`), as ever. Above it
numpy's draw on one host core dominates the engine's start (docs/gpu_checks.md has the figure), so one jitted
program draws them on the device
instead: `layers.hashed_uniform`, a uniform of the same std per weight, the same values on every platform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.llama import LlamaForCausalLM
from modelspec.spec import ModelSpec

DEVICE_DRAW_PARAMS = 1_000_000_000  # synthetic-1b and synthetic-8b are drawn on the device; tiny and small on the host


def synthetic_model(spec: ModelSpec, dtype: jnp.dtype, seed: int) -> LlamaForCausalLM:
    """The model of synthetic preset `spec` with weights from `seed`: host-drawn normals for small models, a
    device-drawn pattern (`device_drawn_model`) from `DEVICE_DRAW_PARAMS` parameters on."""
    if spec.param_count() < DEVICE_DRAW_PARAMS:
        return LlamaForCausalLM(spec, dtype, rngs=nnx.Rngs(seed))
    return device_drawn_model(spec, dtype, seed)


def device_drawn_model(spec: ModelSpec, dtype: jnp.dtype, seed: int) -> LlamaForCausalLM:
    """`spec`'s model built inside one jit, so every weight is `layers.hashed_uniform` computed on the default
    device (one elementwise kernel per weight shape, no host arrays)."""
    graph, _ = nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(spec, dtype, rngs=nnx.Rngs(seed))))
    state = jax.jit(lambda: nnx.state(LlamaForCausalLM(spec, dtype, rngs=nnx.Rngs(seed))))()
    return nnx.merge(graph, state)
