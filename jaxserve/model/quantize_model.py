"""`--quantization` applied to a built model: which weights are quantized, replaced in place at load.

Apart from `quantize.py` (the codes and their matmul, which `layers.linear` imports) because this part knows the
decoder's modules.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxserve.config.engine import QUANTIZATIONS
from jaxserve.model.layers import MLP
from jaxserve.model.llama import Attention
from jaxserve.model.quantize import QUANTIZERS


def linear_params(model: nnx.Module) -> list[tuple[nnx.Module, str]]:
    """(module, attribute) of every projection weight `layers.linear` multiplies by: attention's qkv and o, the
    MLP's gate_up and down. ValueError for layers quantization does not cover yet (MLA, routed experts)."""
    found = []
    for layer in model.layers:
        if not isinstance(layer.attn, Attention) or not isinstance(layer.mlp, MLP):
            raise ValueError("--quantization covers GQA attention and dense SwiGLU MLPs; this model's "
                             f"{type(layer.attn).__name__}/{type(layer.mlp).__name__} layers are not quantized yet")
        found += [(layer.attn, "qkv"), (layer.attn, "o"), (layer.mlp, "gate_up"), (layer.mlp, "down")]
    return found


def quantize_model(model: nnx.Module, method: str) -> int:
    """Replace every projection weight and the LM head of `model` by their `method` codes and scales, in place
    (each float weight is dropped as soon as it is replaced); returns how many weights were quantized."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    params = linear_params(model)
    quantize = jax.jit(QUANTIZERS[method])
    for module, name in params:
        param = getattr(module, name)
        param.set_value(quantize(param.get_value()))
    if model.lm_head is not None:
        model.lm_head.set_value(quantize(model.lm_head.get_value()))
    else:  # tied: the head gets its own [hidden, vocab] codes; the float embedding stays for the gather
        model.lm_head = nnx.data(nnx.Param(quantize(model.embed.get_value().T)))
    return len(params) + 1
