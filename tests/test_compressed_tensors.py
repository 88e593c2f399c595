"""Pre-quantized checkpoints in the compressed-tensors format (HF hub's fp8/int8 checkpoints): the test quantizes a
random HF checkpoint with numpy into `<layer>.weight` codes plus `<layer>.weight_scale`, with the config.json
`quantization_config` llm-compressor writes; the engine reads the codes as codes, infers --quantization from the
checkpoint, and runs the same tokens as the float checkpoint quantized at load. Unsupported schemes are refused in
one line naming them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxserve import LLM
from jaxserve.cli.main import cli
from jaxserve.measure.eval.perplexity import perplexity
from jaxserve.model.compressed_tensors import read_scheme
from jaxserve.model.quantize import QuantizedWeight, param_bytes
from jaxserve.model.weights import CheckpointError
from tests.test_quantization import ENGINE, GREEDY, hf_folder  # noqa: F401 (a fixture)

CODE = {"int8": (np.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}
PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(0, 96, 12)] for i in range(4)]


def quantization_config(kind: str = "float", strategy: str = "channel", ignore: tuple[str, ...] = ("lm_head",),
                        fmt: str | None = None, **weights) -> dict:
    """What llm-compressor writes into config.json for an FP8-dynamic / W8A8 scheme (weights symmetric, static;
    activations dynamic per token)."""
    return {"quant_method": "compressed-tensors", "format": fmt or f"{kind}-quantized",
            "quantization_status": "compressed", "ignore": list(ignore), "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": kind, "strategy": strategy, "symmetric": True, "dynamic": False,
                            "group_size": None, "actorder": None, "observer": "minmax", **weights},
                "input_activations": {"num_bits": 8, "type": kind, "strategy": "token", "symmetric": True,
                                      "dynamic": True},
                "output_activations": None}}}


def write_compressed(src: str, dst: Path, method: str, strategy: str = "channel",
                     ignore: tuple[str, ...] = ("lm_head",)) -> tuple[Path, dict[str, np.ndarray]]:
    """`src` (an HF float checkpoint) with every Linear but `ignore` quantized with numpy: codes [out, in] and
    weight_scale [out, 1] (channel) or [1] (tensor). Returns the folder and each weight as its codes dequantized."""
    code_dtype, top = CODE[method]
    out, dequantized = {}, {}
    with safe_open(str(Path(src) / "model.safetensors"), framework="numpy") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or w.ndim != 2 or "embed" in name or module in ignore:
            out[name] = w
            continue
        absmax = np.abs(w).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(w).max().reshape(1)
        scale = np.where(absmax > 0, absmax / np.float32(top), 1).astype(np.float32)
        q = w / scale
        q = (np.clip(np.round(q), -127, 127) if method == "int8" else np.clip(q, -448, 448)).astype(code_dtype)
        out[name], out[module + ".weight_scale"] = q, scale
        dequantized[name] = q.astype(np.float32) * scale
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((Path(src) / "config.json").read_text())
    config["quantization_config"] = quantization_config("int" if method == "int8" else "float", strategy, ignore)
    (dst / "config.json").write_text(json.dumps(config))
    return dst, dequantized


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_a_compressed_checkpoint_runs_as_its_weights_quantized_at_load(hf_folder, tmp_path, method):  # noqa: F811
    folder, _ = write_compressed(hf_folder, tmp_path / method, method, ignore=())  # the head quantized too
    loaded, at_load = LLM(str(folder), **ENGINE), LLM(hf_folder, quantization=method, **ENGINE)
    assert loaded.engine.config.quantization == method  # inferred from the checkpoint
    ours, theirs = loaded.engine.runner, at_load.engine.runner
    assert param_bytes(ours.param_leaves) == param_bytes(theirs.param_leaves)  # codes, not floats, were loaded
    assert [leaf.dtype for leaf in ours.param_leaves] == [leaf.dtype for leaf in theirs.param_leaves]
    codes = [(a, b) for a, b in zip(ours.param_leaves, theirs.param_leaves, strict=True) if a.dtype.itemsize == 1]
    assert len(codes) == 4 * 2 + 1  # 2 layers' qkv, o, gate_up, down and the head
    same = sum(int(np.sum(np.asarray(a).view(np.uint8) == np.asarray(b).view(np.uint8))) for a, b in codes)
    assert same == sum(a.size for a, _ in codes)  # numpy's codes are the engine's, bit for bit
    assert tokens(loaded) == tokens(at_load)


def test_per_tensor_scales_and_an_ignored_head(hf_folder, tmp_path):  # noqa: F811
    """Per-tensor scales (q, k and v each their own, fused into one qkv) multiply exactly what numpy's codes
    stand for; the ignored lm_head stays float32."""
    folder, dequantized = write_compressed(hf_folder, tmp_path / "tensor", "fp8", strategy="tensor")
    reference = tmp_path / "dequantized"  # the same weights as float32: what the codes times the scales are
    shutil.copytree(hf_folder, reference)
    with safe_open(str(reference / "model.safetensors"), framework="numpy") as f:
        tensors = {name: dequantized.get(name, f.get_tensor(name)) for name in f.keys()}  # noqa: SIM118
    save_file(tensors, str(reference / "model.safetensors"))
    loaded, float_ref = LLM(str(folder), **ENGINE), LLM(str(reference), **ENGINE)
    head = loaded.engine.runner.params["lm_head"].get_value()
    assert not isinstance(head, QuantizedWeight) and head.dtype == jnp.float32
    qkv = loaded.engine.runner.params["layers"][0]["attn"]["qkv"].get_value()
    assert qkv.q.dtype == jnp.float8_e4m3fn and len(np.unique(np.asarray(qkv.scale))) == 3  # q, k, v scales
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 96, 600)]
    ppl_q, ppl_f = perplexity(loaded.engine, ids, 200).perplexity, perplexity(float_ref.engine, ids, 200).perplexity
    assert ppl_q == pytest.approx(ppl_f, rel=1e-4)


def test_a_conflicting_quantization_flag_is_one_line(hf_folder, tmp_path):  # noqa: F811
    folder, _ = write_compressed(hf_folder, tmp_path / "fp8", "fp8")
    with pytest.raises(ValueError, match="--quantization int8 conflicts with the checkpoint's fp8 weights"):
        LLM(str(folder), quantization="int8", **ENGINE)
    res = CliRunner().invoke(cli, ["generate", "--model", str(folder), "--quantization", "int8", "--prompt", "x"])
    assert res.exit_code == 2 and "conflicts with the checkpoint's fp8" in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("change, named", [
    (dict(fmt="pack-quantized", num_bits=4, kind="int", strategy="group", group_size=128), "pack-quantized"),
    (dict(kind="int", strategy="group", group_size=128), "weight strategy 'group'"),
    (dict(num_bits=4, kind="int"), "int 4-bit weights"),
    (dict(strategy="block", block_structure=[128, 128]), "weight strategy 'block'"),
    (dict(symmetric=False, kind="int"), "asymmetric weights"),
    (dict(actorder="group", kind="int"), "activation ordering"),
])
def test_unsupported_schemes_are_refused_naming_them(change, named):
    kind, fmt, strategy = change.pop("kind", "float"), change.pop("fmt", None), change.pop("strategy", "channel")
    with pytest.raises(CheckpointError, match=named):
        read_scheme({"quantization_config": quantization_config(kind, strategy, fmt=fmt, **change)})


def test_static_activation_scales_and_other_methods_are_refused():
    config = quantization_config()
    config["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(CheckpointError, match="static float 8-bit activation quantization"):
        read_scheme({"quantization_config": config})
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported"):
        read_scheme({"quantization_config": {"quant_method": "gptq", "bits": 4}})
    kv = quantization_config()
    kv["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    with pytest.raises(CheckpointError, match="kv_cache_scheme"):
        read_scheme({"quantization_config": kv})
    assert read_scheme({}) is None
    assert read_scheme({"quantization_config": quantization_config("int", "tensor")}).method == "int8"


def test_an_unsupported_checkpoint_is_refused_before_it_loads(hf_folder, tmp_path):  # noqa: F811
    folder, _ = write_compressed(hf_folder, tmp_path / "int4", "int8")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config("int", "group", num_bits=4, group_size=32,
                                                        fmt="pack-quantized")
    (folder / "config.json").write_text(json.dumps(config))
    res = CliRunner().invoke(cli, ["generate", "--model", str(folder), "--prompt", "x"])
    assert res.exit_code == 2 and "pack-quantized" in res.output and "Traceback" not in res.output
