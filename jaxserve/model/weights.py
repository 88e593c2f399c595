"""HF safetensors checkpoints -> model parameters, one tensor at a time.

The model is built shape-only (`nnx.eval_shape`); each parameter is then allocated once on the device and
filled tensor by tensor through a donated `dynamic_update_slice`, so the host holds about one checkpoint
tensor at a time. One declarative table per attention kind (`WEIGHT_RULES`, `MLA_RULES`) plus the experts' table
(`MOE_RULES`) says which HF tensor goes where: the parameter path, the slot inside a fused parameter (an expert's
index from the name), and whether to transpose. Experts load from either layout HF has written: one tensor per
expert (`experts.3.gate_proj`, Mixtral's `experts.3.w1`; the published checkpoints) or transformers 5's fused
`experts.gate_up_proj` [E, 2I, hidden] / `experts.down_proj` [E, hidden, I]. `PARTITION_SPECS` gives each parameter's
tensor-parallel layout (mesh axis "tp") for later sharded loading.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

from jaxserve.model.dtypes import resolve_dtype
from jaxserve.model.llama import LlamaForCausalLM
from modelspec.spec import ModelSpec, load_model_spec

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v2")


class CheckpointError(ValueError):
    """A checkpoint folder this loader cannot read (missing files or tensors, unknown architecture)."""


@dataclass(frozen=True)
class WeightRule:
    """Where one HF tensor goes.

    `hf` is a regex over HF names whose first group (the layer) fills `{}` in `param` (a dotted NNX path).
    `place(spec, w, *rest)` turns the HF array into (value, start): the block written at `start` (a tuple of
    offsets) of the parameter; `rest` are the regex's further groups as ints (an expert's index).
    """

    hf: str
    param: str
    place: Callable[..., tuple[jax.Array, tuple[int, ...]]]


def _whole(spec: ModelSpec, w: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
    return w, (0,) * w.ndim


def _transposed(spec: ModelSpec, w: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
    return w.T, (0, 0)


def _expert_gate_up(index: int) -> Callable[..., tuple[jax.Array, tuple[int, ...]]]:
    """One expert's gate (0) or up (1) [I, hidden] into experts_gate_up [E, hidden, 2, I]."""

    def place(spec: ModelSpec, w: jax.Array, expert: int) -> tuple[jax.Array, tuple[int, ...]]:
        return w.T[None, :, None, :], (expert, 0, index, 0)

    return place


def _expert_down(spec: ModelSpec, w: jax.Array, expert: int) -> tuple[jax.Array, tuple[int, ...]]:
    return w.T[None], (expert, 0, 0)


def _fused_gate_up(spec: ModelSpec, w: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
    """transformers 5's [E, 2I, hidden] (gate rows, then up rows) -> [E, hidden, 2, I]."""
    e, two_i, hidden = w.shape
    return jnp.transpose(w.reshape(e, 2, two_i // 2, hidden), (0, 3, 1, 2)), (0, 0, 0, 0)


def _fused_down(spec: ModelSpec, w: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
    return jnp.transpose(w, (0, 2, 1)), (0, 0, 0)


def _qkv_slot(part: str, bias: bool) -> Callable[[ModelSpec, jax.Array], tuple[jax.Array, tuple[int, ...]]]:
    """q/k/v weight [heads*D, hidden] (or bias [heads*D]) into qkv [hidden, kvh, group+2, D] / [kvh, group+2, D]."""

    def place(spec: ModelSpec, w: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
        kvh, d = spec.num_kv_heads, spec.head_dim
        g = spec.num_heads // kvh
        width, slot = {"q": (g, 0), "k": (1, g), "v": (1, g + 1)}[part]
        if bias:
            return w.reshape(kvh, width, d), (0, slot, 0)
        return w.T.reshape(w.shape[1], kvh, width, d), (0, 0, slot, 0)

    return place


def _gate_up_slot(index: int) -> Callable[[ModelSpec, jax.Array], tuple[jax.Array, tuple[int, ...]]]:
    def place(spec: ModelSpec, w: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
        return w.T[:, None, :], (0, index, 0)

    return place


_L = r"model\.layers\.(\d+)\."
WEIGHT_RULES: list[WeightRule] = [
    WeightRule(r"model\.embed_tokens\.weight", "embed", _whole),
    WeightRule(r"lm_head\.weight", "lm_head", _transposed),
    WeightRule(r"model\.norm\.weight", "norm.weight", _whole),
    WeightRule(_L + r"input_layernorm\.weight", "layers.{}.input_norm.weight", _whole),
    WeightRule(_L + r"post_attention_layernorm\.weight", "layers.{}.post_attn_norm.weight", _whole),
    WeightRule(_L + r"mlp\.gate_proj\.weight", "layers.{}.mlp.gate_up", _gate_up_slot(0)),
    WeightRule(_L + r"mlp\.up_proj\.weight", "layers.{}.mlp.gate_up", _gate_up_slot(1)),
    WeightRule(_L + r"mlp\.down_proj\.weight", "layers.{}.mlp.down", _transposed),
]
GQA_RULES: list[WeightRule] = [
    *[WeightRule(_L + rf"self_attn\.{p}_proj\.weight", "layers.{}.attn.qkv", _qkv_slot(p, False)) for p in "qkv"],
    *[WeightRule(_L + rf"self_attn\.{p}_proj\.bias", "layers.{}.attn.qkv_bias", _qkv_slot(p, True)) for p in "qkv"],
    WeightRule(_L + r"self_attn\.o_proj\.weight", "layers.{}.attn.o", _transposed),
    WeightRule(_L + r"self_attn\.q_norm\.weight", "layers.{}.attn.q_norm.weight", _whole),
    WeightRule(_L + r"self_attn\.k_norm\.weight", "layers.{}.attn.k_norm.weight", _whole),
]
# DeepSeek's multi-head latent attention (`mla.LatentAttention`).
MLA_RULES: list[WeightRule] = [
    *[WeightRule(_L + rf"self_attn\.{hf}\.weight", f"layers.{{}}.attn.{ours}", _transposed)
      for hf, ours in (("q_proj", "q"), ("q_a_proj", "q_a"), ("q_b_proj", "q_b"), ("kv_a_proj_with_mqa", "kv_a"),
                       ("kv_b_proj", "kv_b"), ("o_proj", "o"))],
    WeightRule(_L + r"self_attn\.q_a_layernorm\.weight", "layers.{}.attn.q_a_norm.weight", _whole),
    WeightRule(_L + r"self_attn\.kv_a_layernorm\.weight", "layers.{}.attn.kv_a_norm.weight", _whole),
]
# Routed experts (Mixtral's `block_sparse_moe` or everyone else's `mlp`) and DeepSeek's shared experts.
_M = _L + r"(?:block_sparse_moe|mlp)\."
MOE_RULES: list[WeightRule] = [
    WeightRule(_M + r"gate\.weight", "layers.{}.mlp.router", _transposed),
    WeightRule(_M + r"experts\.(\d+)\.(?:gate_proj|w1)\.weight", "layers.{}.mlp.experts_gate_up", _expert_gate_up(0)),
    WeightRule(_M + r"experts\.(\d+)\.(?:up_proj|w3)\.weight", "layers.{}.mlp.experts_gate_up", _expert_gate_up(1)),
    WeightRule(_M + r"experts\.(\d+)\.(?:down_proj|w2)\.weight", "layers.{}.mlp.experts_down", _expert_down),
    WeightRule(_M + r"experts\.gate_up_proj", "layers.{}.mlp.experts_gate_up", _fused_gate_up),
    WeightRule(_M + r"experts\.down_proj", "layers.{}.mlp.experts_down", _fused_down),
    WeightRule(_L + r"mlp\.shared_experts\.gate_proj\.weight", "layers.{}.mlp.shared.gate_up", _gate_up_slot(0)),
    WeightRule(_L + r"mlp\.shared_experts\.up_proj\.weight", "layers.{}.mlp.shared.gate_up", _gate_up_slot(1)),
    WeightRule(_L + r"mlp\.shared_experts\.down_proj\.weight", "layers.{}.mlp.shared.down", _transposed),
]


def rules_for(spec: ModelSpec) -> list[WeightRule]:
    """The rules of `spec`'s architecture: shared ones, its attention's, and the experts' if it has any."""
    return WEIGHT_RULES + (MLA_RULES if spec.is_mla else GQA_RULES) + (MOE_RULES if spec.is_moe else [])
# HF tensors that carry no parameters here.
IGNORED = (re.compile(r".*rotary_emb\.inv_freq"),)

# Tensor-parallel layouts (mesh axis "tp"): column-parallel qkv (by KV head) and gate_up, row-parallel o and down,
# vocab-parallel embedding and head; norms replicated. Keyed by the parameter path with layer numbers as "*".
PARTITION_SPECS: dict[str, P] = {
    "embed": P("tp", None),
    "lm_head": P(None, "tp"),
    "norm.weight": P(),
    "layers.*.input_norm.weight": P(),
    "layers.*.post_attn_norm.weight": P(),
    "layers.*.attn.qkv": P(None, "tp", None, None),
    "layers.*.attn.qkv_bias": P("tp", None, None),
    "layers.*.attn.o": P("tp", None),
    "layers.*.attn.q_norm.weight": P(),
    "layers.*.attn.k_norm.weight": P(),
    "layers.*.mlp.gate_up": P(None, None, "tp"),
    "layers.*.mlp.down": P("tp", None),
    # Experts: tensor parallel over each expert's intermediate axis (moe.py); the router is replicated.
    "layers.*.mlp.router": P(),
    "layers.*.mlp.experts_gate_up": P(None, None, None, "tp"),
    "layers.*.mlp.experts_down": P(None, "tp", None),
    "layers.*.mlp.shared.gate_up": P(None, None, "tp"),
    "layers.*.mlp.shared.down": P("tp", None),
    # MLA (one device for now: parallel.check_tp refuses tp > 1): replicated.
    **{f"layers.*.attn.{name}": P() for name in ("q", "q_a", "q_b", "kv_a", "kv_b", "q_a_norm.weight",
                                                  "kv_a_norm.weight")},
}


def partition_spec(path: str) -> P:
    """The PartitionSpec of a dotted parameter path (e.g. "layers.3.attn.qkv")."""
    return PARTITION_SPECS[re.sub(r"\.\d+\.", ".*.", path)]


def _path_str(path: tuple) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def abstract_model(spec: ModelSpec, dtype: jnp.dtype | str = "auto") -> LlamaForCausalLM:
    """The model with ShapeDtypeStruct leaves (no memory, no compute)."""
    if spec.architecture not in SUPPORTED:
        raise CheckpointError(f"architecture {spec.architecture!r} is not supported by the Llama-family model "
                              f"(supported: {', '.join(SUPPORTED)})")
    dtype = resolve_dtype(dtype)
    return nnx.eval_shape(lambda: LlamaForCausalLM(spec, dtype, rngs=nnx.Rngs(0)))


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no model.safetensors, model.safetensors.index.json or *.safetensors")
    return files


def iter_hf_tensors(folder: str | Path) -> Iterator[tuple[str, jax.Array]]:
    """Yield (name, array) one tensor at a time from a safetensors checkpoint folder."""
    for file in _safetensors_files(Path(folder)):
        with safe_open(str(file), framework="flax") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def _match(name: str, rules: list[WeightRule]) -> tuple[str, WeightRule, tuple[int, ...]] | None:
    for rule in rules:
        m = re.fullmatch(rule.hf, name)
        if m:
            groups = m.groups()
            return rule.param.format(*groups[:1]), rule, tuple(int(g) for g in groups[1:])
    return None


@jax.jit
def _convert(w: jax.Array, like: jax.Array) -> jax.Array:
    return w.astype(like.dtype)


def _write(param: jax.Array, value: jax.Array, start: tuple[int, ...]) -> jax.Array:
    return lax.dynamic_update_slice(param, value.astype(param.dtype), start)


_write_donated = jax.jit(_write, donate_argnums=0, static_argnums=2)


def load_hf_checkpoint(folder: str | Path, spec: ModelSpec | None = None, dtype: jnp.dtype | str = "auto",
                       mesh: jax.sharding.Mesh | None = None) -> LlamaForCausalLM:
    """Read an HF safetensors folder into a `LlamaForCausalLM`, one tensor at a time.

    With `mesh`, each parameter is allocated with its `PARTITION_SPECS` sharding over the mesh.
    """
    folder = Path(folder)
    spec = spec or load_model_spec(str(folder))
    _warn_unsupported(folder)
    abstract = abstract_model(spec, dtype)
    graphdef, state = nnx.split(abstract)
    flat = {_path_str(p): leaf.get_value() for p, leaf in nnx.to_flat_state(state)}
    params: dict[str, jax.Array] = {}
    filled: dict[str, int] = {k: 0 for k in flat}
    rules = rules_for(spec)
    for name, w in iter_hf_tensors(folder):
        found = _match(name, rules)
        if found is None:
            if spec.tie_word_embeddings and name == "lm_head.weight" or any(r.fullmatch(name) for r in IGNORED):
                continue
            raise CheckpointError(f"{folder}: unexpected tensor {name!r} for architecture {spec.architecture}")
        path, rule, idx = found
        if path not in flat:
            raise CheckpointError(f"{folder}: tensor {name!r} has no parameter {path!r} (check config.json)")
        target = flat[path]
        if idx and idx[0] >= target.shape[0]:
            raise CheckpointError(f"{folder}: tensor {name!r}: expert {idx[0]} of {target.shape[0]}")
        value, start = rule.place(spec, w, *idx)
        if path not in params:
            if tuple(value.shape) == tuple(target.shape):  # a whole parameter: no zero-filled buffer needed
                params[path] = _place(_convert(value, target), path, mesh)
                filled[path] += value.size
                continue
            params[path] = _place(jnp.zeros(target.shape, target.dtype), path, mesh)
        if any(s + n > m for s, n, m in zip(start, value.shape, target.shape, strict=True)):
            raise CheckpointError(f"{folder}: tensor {name!r} {tuple(w.shape)} does not fit {path} "
                                  f"{tuple(target.shape)}")
        params[path] = _write_donated(params[path], _place(value, path, mesh), start)
        filled[path] += value.size
        del w, value
    missing = [p for p, leaf in flat.items() if filled[p] != int(np.prod(leaf.shape))]
    if missing:
        raise CheckpointError(f"{folder}: parameters missing or incomplete: {', '.join(missing)}")
    return _merge(graphdef, state, params)


def _warn_unsupported(folder: Path) -> None:
    """Warn about config features the model ignores (sliding-window attention)."""
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True) and window < config.get("max_position_embeddings", 0):
        warnings.warn(f"{folder}: sliding_window={window} is not implemented; attention is full, so outputs differ "
                      f"from the reference past {window} tokens", stacklevel=3)


def _place(x: jax.Array, path: str, mesh: jax.sharding.Mesh | None) -> jax.Array:
    if mesh is None:
        return x
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, partition_spec(path)))


def _merge(graphdef: nnx.GraphDef, state: nnx.State, params: dict[str, jax.Array]) -> LlamaForCausalLM:
    flat = nnx.to_flat_state(state)
    leaves = [(p, leaf.replace(params[_path_str(p)])) for p, leaf in flat]
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))
