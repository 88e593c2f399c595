"""Checkpoint folders: load (HF safetensors or our converted orbax format), convert, and export to HF.

A converted folder holds `jaxserve_params.json` (the marker), the orbax-saved parameters in `params/`, and
the source's `config.json` and tokenizer files, so `load_model_spec` and `load_tokenizer` work on it too.
Loading it restores the fused, pre-transposed arrays directly: no per-tensor transposes or fusions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from safetensors.numpy import save_file

from jaxserve.model.compressed_tensors import folder_scheme, load_compressed_tensors
from jaxserve.model.dtypes import resolve_dtype
from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.weights import CheckpointError, abstract_model, load_hf_checkpoint
from modelspec.spec import ModelSpec, load_model_spec

MARKER = "jaxserve_params.json"
FORMAT = "jaxserve-orbax-v1"  # PyTree of NNX params, OCDBT, uncompressed
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "tokenizer.model")


def _checkpointer() -> ocp.PyTreeCheckpointer:
    # Uncompressed: zstd (orbax's default) made restoring slower than reading the safetensors source.
    return ocp.PyTreeCheckpointer(use_ocdbt=True, use_zarr3=False, use_compression=False)


def is_converted(folder: str | Path) -> bool:
    """Whether `folder` was written by `convert` (or `save_converted`)."""
    return (Path(folder) / MARKER).is_file()


def save_converted(model: LlamaForCausalLM, dst: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Save the model's params with orbax plus the marker file; `dst` must not hold params yet."""
    dst = Path(dst).expanduser().resolve()
    dst.mkdir(parents=True, exist_ok=True)
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    _checkpointer().save(dst / "params", state)
    dtype = jnp.dtype(model.dtype).name
    (dst / MARKER).write_text(json.dumps({"format": FORMAT, "dtype": dtype, **(extra or {})}, indent=1))


def load_converted(folder: str | Path, spec: ModelSpec, dtype: jnp.dtype | str = "auto") -> LlamaForCausalLM:
    """Restore params saved by `save_converted` into a model of `spec` (cast to `dtype` if it differs)."""
    folder = Path(folder).expanduser().resolve()
    meta = json.loads((folder / MARKER).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder}: unknown converted format {meta.get('format')!r} (expected {FORMAT})")
    dtype = resolve_dtype(dtype)
    graphdef, abstract_state = nnx.split(abstract_model(spec, meta["dtype"]))
    target = nnx.to_pure_dict(abstract_state)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(dtype=x.dtype, sharding=device), target)
    restored = _checkpointer().restore(folder / "params", args=ocp.args.PyTreeRestore(target, restore_args))
    if jnp.dtype(meta["dtype"]) != dtype:
        restored = jax.tree.map(lambda x: x.astype(dtype), restored)
        graphdef, abstract_state = nnx.split(abstract_model(spec, dtype))
    nnx.replace_by_pure_dict(abstract_state, restored)
    return nnx.merge(graphdef, abstract_state)


def load_checkpoint(folder: str | Path, spec: ModelSpec | None = None, dtype: jnp.dtype | str = "auto",
                    mesh: jax.sharding.Mesh | None = None) -> LlamaForCausalLM:
    """Load a folder written by `checkpoint.convert` (fast path) or an HF safetensors folder (pre-quantized in the
    compressed-tensors format: its Linears as `QuantizedWeight` codes, on one device, `mesh` unused)."""
    folder = Path(folder).expanduser()
    spec = spec or load_model_spec(str(folder))
    if is_converted(folder):
        return load_converted(folder, spec, dtype)
    scheme = folder_scheme(folder)
    if scheme is not None:
        return load_compressed_tensors(folder, spec, dtype, scheme)
    return load_hf_checkpoint(folder, spec, dtype, mesh=mesh)


def convert(src: str | Path, dst: str | Path, dtype: jnp.dtype | str | None = None) -> Path:
    """Convert an HF safetensors folder into our orbax format (params in `dtype`, default float32)."""
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    if is_converted(dst) or (dst / "params").exists():
        raise CheckpointError(f"{dst}: already holds converted params; choose an empty folder")
    if folder_scheme(src) is not None:
        raise CheckpointError(f"{src}: a pre-quantized (compressed-tensors) checkpoint is served from its folder; "
                              "convert takes float checkpoints")
    spec = load_model_spec(str(src))
    model = load_checkpoint(src, spec, dtype or jnp.float32)
    save_converted(model, dst, {"source": str(src)})
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return dst


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """An HF `config.json` dict for a dense Llama-family spec (export does not write experts or MLA yet)."""
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}
    if spec.architecture not in arch:
        raise CheckpointError(f"exporting {spec.architecture} to HF is not supported (dense families only: "
                              f"{', '.join(arch)})")
    config: dict[str, Any] = {
        "architectures": [arch[spec.architecture]], "model_type": spec.architecture,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta, "rope_scaling": spec.rope_scaling,
        "max_position_embeddings": spec.max_position_embeddings, "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.qkv_bias, "bos_token_id": spec.bos_token_id, "eos_token_id": spec.eos_token_id,
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    return config


def save_hf_checkpoint(model: LlamaForCausalLM, spec: ModelSpec, dst: str | Path,
                       max_shard_bytes: int | None = None) -> Path:
    """Write the model as an HF safetensors folder (for tests and benchmarks), sharded if asked."""
    config = hf_config(spec)
    dst = Path(dst).expanduser()
    dst.mkdir(parents=True, exist_ok=True)
    tensors = dict(_hf_tensors(model, spec))
    if max_shard_bytes is None:
        save_file(tensors, str(dst / "model.safetensors"))
    else:
        shards: list[dict[str, np.ndarray]] = [{}]
        for name, t in tensors.items():
            if shards[-1] and sum(x.nbytes for x in shards[-1].values()) + t.nbytes > max_shard_bytes:
                shards.append({})
            shards[-1][name] = t
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(dst / fname))
            weight_map.update(dict.fromkeys(shard, fname))
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


def _hf_tensors(model: LlamaForCausalLM, spec: ModelSpec):
    """(HF name, array in HF layout) for every parameter: the inverse of weights.WEIGHT_RULES."""
    g = spec.num_heads // spec.num_kv_heads
    a = lambda x: np.ascontiguousarray(np.asarray(x))
    yield "model.embed_tokens.weight", a(model.embed[...])
    if model.lm_head is not None:
        yield "lm_head.weight", a(model.lm_head[...].T)
    yield "model.norm.weight", a(model.norm.weight[...])
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv = np.asarray(layer.attn.qkv[...])
        hidden = qkv.shape[0]
        yield p + "self_attn.q_proj.weight", a(qkv[:, :, :g].reshape(hidden, -1).T)
        yield p + "self_attn.k_proj.weight", a(qkv[:, :, g].reshape(hidden, -1).T)
        yield p + "self_attn.v_proj.weight", a(qkv[:, :, g + 1].reshape(hidden, -1).T)
        if layer.attn.qkv_bias is not None:
            b = np.asarray(layer.attn.qkv_bias[...])
            yield p + "self_attn.q_proj.bias", a(b[:, :g].reshape(-1))
            yield p + "self_attn.k_proj.bias", a(b[:, g].reshape(-1))
            yield p + "self_attn.v_proj.bias", a(b[:, g + 1].reshape(-1))
        yield p + "self_attn.o_proj.weight", a(layer.attn.o[...].T)
        if layer.attn.q_norm is not None:
            yield p + "self_attn.q_norm.weight", a(layer.attn.q_norm.weight[...])
            yield p + "self_attn.k_norm.weight", a(layer.attn.k_norm.weight[...])
        gu = np.asarray(layer.mlp.gate_up[...])
        yield p + "mlp.gate_proj.weight", a(gu[:, 0].T)
        yield p + "mlp.up_proj.weight", a(gu[:, 1].T)
        yield p + "mlp.down_proj.weight", a(layer.mlp.down[...].T)
        yield p + "input_layernorm.weight", a(layer.input_norm.weight[...])
        yield p + "post_attention_layernorm.weight", a(layer.post_attn_norm.weight[...])
