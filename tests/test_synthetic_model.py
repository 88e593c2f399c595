"""Synthetic presets' weights: host-drawn normals for small models, one jitted draw on the device for large ones
(`synthetic-1b`, `synthetic-8b`), whose numpy draw on one host core would dominate an engine's start."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.synthetic import DEVICE_DRAW_PARAMS, device_drawn_model, synthetic_model
from modelspec.spec import PRESETS


def _params(model) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in
            jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}


def test_large_synthetic_presets_are_drawn_on_the_device_small_ones_on_the_host():
    assert PRESETS["synthetic-8b"].param_count() > 8e9 and not PRESETS["synthetic-8b"].tie_word_embeddings
    assert PRESETS["synthetic-1b"].param_count() >= DEVICE_DRAW_PARAMS > PRESETS["small"].param_count()
    tiny = _params(synthetic_model(PRESETS["tiny"], jnp.float32, 0))
    host = _params(LlamaForCausalLM(PRESETS["tiny"], jnp.float32, rngs=nnx.Rngs(0)))
    assert all(np.array_equal(tiny[k], host[k]) for k in host)  # tiny keeps its host-drawn normals


def test_the_device_draw_matches_the_host_draw_in_shape_dtype_and_spread():
    spec = PRESETS["tiny"]
    assert {v.dtype for v in _params(device_drawn_model(spec, jnp.bfloat16, 0)).values()} == {jnp.dtype(jnp.bfloat16)}
    device = _params(device_drawn_model(spec, jnp.float32, 0))
    host = _params(LlamaForCausalLM(spec, jnp.float32, rngs=nnx.Rngs(0)))
    assert device.keys() == host.keys()
    for name, h in host.items():
        d = device[name]
        assert d.shape == h.shape and d.dtype == h.dtype, name
        if "norm" in name:  # norms start at one either way
            assert np.all(d == 1), name
            continue
        assert abs(d.std() / h.std() - 1) < 0.1 and abs(d.mean()) < 0.1 * h.std(), name
        assert len(np.unique(d)) > d.size // 2, name  # a spread of values, not a pattern of a few


def test_the_device_draw_is_seeded_and_each_weight_differs():
    spec = PRESETS["tiny"]
    a, b, c = (_params(device_drawn_model(spec, jnp.float32, seed)) for seed in (3, 3, 4))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    weights = [k for k in a if "norm" not in k]
    assert not any(np.array_equal(a[k], c[k]) for k in weights)
    assert not np.array_equal(a["['layers'][0]['attn']['o'].value"], a["['layers'][1]['attn']['o'].value"])
