"""Pre-quantized checkpoints in the compressed-tensors format (HF hub's fp8 and int8 checkpoints, llm-compressor's).

config.json's `quantization_config` (`quant_method: "compressed-tensors"`, a `format`, `config_groups` of
`{targets, weights, input_activations}`, `ignore`) says how each quantized Linear is stored: `<name>.weight`, 8-bit
codes in HF's [out, in] layout (int8, or float8_e4m3fn for `type: "float"`), and `<name>.weight_scale`, [out, 1]
per output channel or [1] / [] per tensor (W ~= codes * scale, symmetric). The codes are read as codes into
`QuantizedWeight`s, never through a float copy: transposed into jaxserve's [in, out...] layout and fused (qkv,
gate/up) by the float loader's rules (`weights.rules_for`), the scales laid out like the output axes (a per-tensor
scale repeated over its tensor's channels, which is exact). Tensors with no scale (the `ignore` list: usually
lm_head) load as float weights. What jaxserve cannot run is refused in one line naming it: other bit widths and
strategies (group-wise int4, blocks), asymmetric or dynamic weights, static activation scales (dynamic activation
quantization is accepted: activations stay in the model's float dtype), sparsity, KV-cache schemes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.quantize import CODE_DTYPES, QuantizedWeight
from jaxserve.model.weights import (
    IGNORED,
    CheckpointError,
    _convert,
    _match,
    _merge,
    _path_str,
    _safetensors_files,
    _write_donated,
    abstract_model,
    rules_for,
)
from modelspec.spec import ModelSpec

QUANT_METHOD = "compressed-tensors"
# compressed-tensors' formats that store each weight as plain 8-bit codes, and the weight type each allows.
FORMATS = {"float-quantized": ("float",), "int-quantized": ("int",), "naive-quantized": ("int", "float")}
STRATEGIES = ("channel", "tensor")
# safetensors' dtype names this reader takes, as numpy dtypes (fp8 and bf16 through JAX's ml_dtypes types).
_ST_DTYPES = {"F8_E4M3": jnp.float8_e4m3fn, "I8": np.int8, "U8": np.uint8, "BF16": jnp.bfloat16, "F16": np.float16,
              "F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_}
_CODE_NAMES = {"int8": "I8", "fp8": "F8_E4M3"}
_UNSUPPORTED_TENSORS = {".input_scale": "static activation scales", ".weight_g_idx": "activation ordering (g_idx)",
                        ".weight_shape_original": "padded block quantization", ".weight_packed": "packed codes"}


@dataclass(frozen=True)
class Scheme:
    """What a compressed-tensors checkpoint holds: `method` ("int8" | "fp8") weights with `strategies` scales."""

    method: str
    strategies: tuple[str, ...]


def _refuse(what: str) -> CheckpointError:
    return CheckpointError(f"compressed-tensors {what} is not supported (jaxserve runs 8-bit int or float weights, "
                           "symmetric, per channel or per tensor)")


def read_scheme(config: dict[str, Any]) -> Scheme | None:
    """The scheme of an HF config.json dict, None when it has no `quantization_config`; CheckpointError naming
    what is not supported otherwise."""
    q = config.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"quantization_config quant_method {q.get('quant_method')!r} is not supported "
                              f"(only {QUANT_METHOD!r})")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.get(key):
            raise _refuse(key)
    if q.get("quantization_status", "compressed") != "compressed":
        raise _refuse(f"quantization_status {q.get('quantization_status')!r}")
    groups = q.get("config_groups") or {}
    if not groups:
        raise _refuse("quantization_config without config_groups")
    methods, strategies = set(), set()
    for name, group in groups.items():
        fmt = group.get("format") or q.get("format")
        w = group.get("weights") or {}
        kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
        if fmt not in FORMATS:
            raise _refuse(f"format {fmt!r} ({name})")
        if bits != 8 or kind not in FORMATS[fmt]:
            raise _refuse(f"{kind} {bits}-bit weights in format {fmt!r} ({name})")
        if strategy not in STRATEGIES:
            raise _refuse(f"weight strategy {strategy!r} ({name}, group_size {w.get('group_size')})")
        if w.get("symmetric") is False:
            raise _refuse(f"asymmetric weights ({name})")
        if w.get("dynamic") not in (None, False):
            raise _refuse(f"dynamic weight quantization ({name})")
        if w.get("actorder"):
            raise _refuse(f"activation ordering {w['actorder']!r} ({name})")
        act = group.get("input_activations")
        if act and act.get("dynamic") is not True:
            raise _refuse(f"static {act.get('type')} {act.get('num_bits')}-bit activation quantization ({name})")
        if group.get("output_activations"):
            raise _refuse(f"output activation quantization ({name})")
        methods.add("int8" if kind == "int" else "fp8")
        strategies.add(strategy)
    if len(methods) > 1:
        raise _refuse(f"a mix of weight types {sorted(methods)}")
    return Scheme(methods.pop(), tuple(sorted(strategies)))


def folder_scheme(folder: str | Path) -> Scheme | None:
    """`read_scheme` of a checkpoint folder's config.json (None without one)."""
    config = Path(folder) / "config.json"
    return read_scheme(json.loads(config.read_text())) if config.is_file() else None


def _headers(folder: Path) -> dict[str, tuple[Path, dict[str, Any], int]]:
    """name -> (file, safetensors header entry, offset of the file's data) for every tensor of the folder."""
    out = {}
    for file in _safetensors_files(folder):
        with open(file, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        out.update({name: (file, entry, 8 + n) for name, entry in header.items()})
    return out


def _read(file: Path, entry: dict[str, Any], offset: int) -> np.ndarray:
    """One tensor as stored (codes stay codes), read from its byte range."""
    if entry["dtype"] not in _ST_DTYPES:
        raise CheckpointError(f"{file}: tensor dtype {entry['dtype']} is not supported")
    start, end = entry["data_offsets"]
    with open(file, "rb") as f:
        f.seek(offset + start)
        data = f.read(end - start)
    return np.frombuffer(data, dtype=_ST_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def _channel_scale(scale: np.ndarray, rows: int, name: str) -> np.ndarray:
    """A weight_scale as one float32 per output channel ([rows, 1] or [rows] as is, [1] or [] repeated)."""
    s = np.asarray(scale, np.float32)
    if s.size == 1:
        return np.full((rows,), s.reshape(()), np.float32)
    if s.shape in ((rows, 1), (rows,)):
        return s.reshape(rows)
    raise _refuse(f"weight_scale of shape {list(s.shape)} for {rows} output channels ({name}: group or block scales)")


def load_compressed_tensors(folder: str | Path, spec: ModelSpec, dtype: Any, scheme: Scheme) -> LlamaForCausalLM:
    """Read a compressed-tensors folder into a model whose quantized Linears are `QuantizedWeight`s (codes read as
    codes), the rest in `dtype`. One device; tensors are read one at a time."""
    folder = Path(folder)
    if spec.is_moe or spec.is_mla:
        raise CheckpointError(f"{folder}: compressed-tensors checkpoints of MoE or MLA models are not supported yet")
    headers = _headers(folder)
    graphdef, state = nnx.split(abstract_model(spec, dtype))
    flat = {_path_str(p): leaf.get_value() for p, leaf in nnx.to_flat_state(state)}
    rules = rules_for(spec)
    scaled = {n.removesuffix("_scale") for n in headers if n.endswith(".weight_scale")}
    quantized = {}  # parameter path -> code dtype, for every parameter some scaled tensor fills
    for name in scaled:
        found = _match(name, rules)
        if found is None or found[0] not in flat or name not in headers:
            raise CheckpointError(f"{folder}: {name}_scale scales no weight this model has")
        if headers[name][1]["dtype"] != _CODE_NAMES[scheme.method]:
            raise _refuse(f"{headers[name][1]['dtype']} codes in a {scheme.method} checkpoint ({name})")
        quantized[found[0]] = CODE_DTYPES[scheme.method]
    targets = dict(flat)
    for path, code in quantized.items():  # codes in the parameter's place, scales beside them under "path#scale"
        targets[path] = jax.ShapeDtypeStruct(flat[path].shape, code)
        targets[path + "#scale"] = jax.ShapeDtypeStruct(flat[path].shape[1:], jnp.float32)
    params: dict[str, jax.Array] = {}
    filled = dict.fromkeys(targets, 0)
    for name, (file, entry, offset) in headers.items():
        bad = next((what for suffix, what in _UNSUPPORTED_TENSORS.items() if name.endswith(suffix)), None)
        if bad:
            raise _refuse(f"{bad} ({name})")
        if name.endswith(".weight_zero_point"):
            if np.any(_read(file, entry, offset)):
                raise _refuse(f"asymmetric weights (nonzero {name})")
            continue
        weight = name.removesuffix("_scale")
        found = _match(weight, rules)
        if found is None:
            if spec.tie_word_embeddings and name == "lm_head.weight" or any(r.fullmatch(name) for r in IGNORED):
                continue
            raise CheckpointError(f"{folder}: unexpected tensor {name!r} for architecture {spec.architecture}")
        path, rule, idx = found
        if path not in flat:
            raise CheckpointError(f"{folder}: tensor {name!r} has no parameter {path!r} (check config.json)")
        w = _read(file, entry, offset)
        if name.endswith(".weight_scale"):
            rows = headers[weight][1]["shape"][0]
            value, start = rule.place(spec, jnp.asarray(_channel_scale(w, rows, name))[:, None], *idx)
            key, value, start = path + "#scale", value[0], start[1:]
        elif path in quantized and name not in scaled:
            raise CheckpointError(f"{folder}: {name!r} is float where the rest of {path} is quantized")
        else:
            key, (value, start) = path, rule.place(spec, jnp.asarray(w), *idx)
        _fill(params, filled, targets[key], key, value, start, name, folder)
    missing = [k for k, t in targets.items() if filled[k] != int(np.prod(t.shape))]
    if missing:
        raise CheckpointError(f"{folder}: parameters missing or incomplete: {', '.join(missing)}")
    for path in quantized:
        params[path] = QuantizedWeight(params[path], params.pop(path + "#scale"))
    return _merge(graphdef, state, params)


def _fill(params: dict[str, jax.Array], filled: dict[str, int], target: Any, key: str, value: jax.Array,
          start: tuple[int, ...], name: str, folder: Path) -> None:
    """Write `value` at `start` of parameter `key` (allocated on first use in the target's dtype: codes stay
    codes, float tensors are cast)."""
    if key not in params:
        if tuple(value.shape) == tuple(target.shape):
            params[key] = _convert(value, target)
            filled[key] += value.size
            return
        params[key] = jnp.zeros(target.shape, target.dtype)
    if any(s + n > m for s, n, m in zip(start, value.shape, target.shape, strict=True)):
        raise CheckpointError(f"{folder}: tensor {name!r} does not fit {key} {tuple(target.shape)}")
    params[key] = _write_donated(params[key], value, start)
    filled[key] += value.size

