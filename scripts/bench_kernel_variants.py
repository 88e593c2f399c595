"""The one-row matmul kernel with other values of `matmul.cc`'s constants, timed in one process, alternating.

    python scripts/bench_kernel_variants.py --variant g8:kRowGroup=8 --variant g4:kRowGroup=4 \
        --variant p16:kRowPrefetchRows=16 --model small --rounds 60 --out reports/kernel_variants.json

Each `--variant NAME:CONST=VALUE[,CONST=VALUE...]` is `matmul.cc` with those `constexpr int` constants replaced,
built into its own library (the build flags of `cpu_kernels`) whose `x @ w` handler is registered under its own
FFI target, so that all variants run side by side in this process and see the same states of the machine (its
bandwidth moved 40-76 GB/s within minutes on the 2-core EPYC; separate processes compared those states, not the
variants). The workload: `--model`'s projections (qkv, o, gate/up, down) at one row, each layer's weights fresh
(`--layers` sets of them, so that they come from memory as a step's do), chained one into the next in one jitted
call, `--row-parts` parts a row. Per variant: the median time, the weight bandwidth, and the median of its
per-round ratios to the first variant.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.kernels.cpu import library as cpu_kernels  # noqa: E402
from jaxserve.measure.calibrate.microbench import measure_bandwidth  # noqa: E402
from modelspec.spec import load_model_spec  # noqa: E402

SOURCE = Path(cpu_kernels.__file__).with_name("matmul.cc")


def parse_variant(text: str) -> tuple[str, dict[str, int]]:
    """NAME:CONST=VALUE,... -> (name, {const: value}); ValueError for anything else."""
    name, _, spec = text.partition(":")
    if not re.fullmatch(r"\w+", name):
        raise ValueError(f"--variant {text!r}: NAME:CONST=VALUE[,CONST=VALUE...] (NAME a word)")
    consts = {}
    for item in filter(None, spec.split(",")):
        const, _, value = item.partition("=")
        if not re.fullmatch(r"k\w+", const) or not re.fullmatch(r"\d+", value):
            raise ValueError(f"--variant {text!r}: {item!r} is not CONST=INTEGER")
        consts[const] = int(value)
    return name, consts


def variant_source(consts: dict[str, int], name: str) -> str:
    """`matmul.cc` with `consts` replaced and its x @ w handler renamed for `name`."""
    src = SOURCE.read_text()
    for const, value in consts.items():
        src, n = re.subn(rf"constexpr int {const} = \d+;", f"constexpr int {const} = {value};", src)
        if n != 1:
            raise ValueError(f"matmul.cc has no `constexpr int {const} = ...;`")
    handler = "XLA_FFI_DEFINE_HANDLER_SYMBOL("
    return src.replace(f"{handler}JaxserveMatmul,", f"{handler}Variant_{name},")


def build_variant(name: str, consts: dict[str, int], folder: Path) -> str:
    """Build the variant into `folder` and register it; returns its FFI target."""
    src = folder / f"matmul_{name}.cc"
    src.write_text(variant_source(consts, name))
    lib = folder / f"matmul_{name}.so"
    include = [f"-I{SOURCE.parent}", f"-I{jax.ffi.include_dir()}"]
    run = subprocess.run([cpu_kernels._compiler(), *cpu_kernels.FLAGS, *include, str(src), "-o", str(lib)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"variant {name} did not build: {run.stderr.strip().splitlines()[-1]}")
    target = f"jaxserve_bench_variant_{name}"
    handler = getattr(ctypes.cdll.LoadLibrary(str(lib)), f"Variant_{name}")
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return target


def projection_shapes(model: str) -> list[tuple[int, int]]:
    """A layer's projections as the model runs them: qkv, o, gate/up (fused), down."""
    s = load_model_spec(model)
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    return [(s.hidden_size, qkv), (s.num_heads * s.head_dim, s.hidden_size), (s.hidden_size, 2 * s.intermediate_size),
            (s.intermediate_size, s.hidden_size)]


def chained(target: str, row_parts: int):
    """The layers' projections at one row, each one's input read from the one before (as a step runs them)."""
    def mm(x, w):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((1, w.shape[1]), jnp.float32))(
            x, w, row_parts=np.int32(row_parts))

    def run(x, layers):
        for qkv, o, gate_up, down in layers:
            h = mm(mm(mm(x, qkv)[:, : o.shape[0]], o), gate_up)
            x = mm(h[:, : down.shape[0]], down) * 1e-3 + x
        return x
    return jax.jit(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME:CONST=VALUE[,CONST=VALUE...]")
    ap.add_argument("--model", default="small")
    ap.add_argument("--layers", type=int, default=12, help="sets of fresh weights (default: small's 12 layers)")
    ap.add_argument("--row-parts", type=int, default=0, help="parts one row cuts a weight into (0: the default)")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    try:
        variants = dict(parse_variant(v) for v in a.variant)
        for name, consts in variants.items():
            variant_source(consts, name)
    except ValueError as e:
        ap.error(str(e))
    if not cpu_kernels.available():
        print("error: jaxserve's CPU kernels are not available on this machine", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory(prefix="jaxserve-kernel-variants-") as folder:
        runs = {name: chained(build_variant(name, consts, Path(folder)), a.row_parts)
                for name, consts in variants.items()}
    shapes = projection_shapes(a.model)
    layers = [[jnp.full(s, 1e-3 + i * 1e-6, jnp.float32) for s in shapes] for i in range(a.layers)]
    nbytes = sum(w.size * 4 for layer in layers for w in layer)
    x = jnp.ones((1, shapes[0][0]), jnp.float32)
    for f in runs.values():
        jax.block_until_ready(f(x, layers))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(a.rounds):
        for name in (list(runs) if i % 2 else list(runs)[::-1]):
            t = time.perf_counter()
            jax.block_until_ready(runs[name](x, layers))
            times[name].append(time.perf_counter() - t)
    first = next(iter(runs))
    rows = [{"variant": name, "constants": variants[name], "ms": 1e3 * statistics.median(ts),
             "weight_gbps": nbytes / statistics.median(ts) / 1e9,
             "ratio_to_first": statistics.median(t / b for t, b in zip(ts, times[first], strict=True))}
            for name, ts in times.items()]
    for row in rows:
        print(f"{row['variant']:>12}: {row['ms']:.3f} ms, {row['weight_gbps']:.1f} GB/s, "
              f"{row['ratio_to_first']:.3f}x {first}", flush=True)
    stream = measure_bandwidth(1 << 30) / 1e9
    print(f"streaming sum after: {stream:.1f} GB/s")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"model": a.model, "layers": a.layers, "row_parts": a.row_parts,
                                           "rounds": a.rounds, "weight_mb": nbytes / 1e6, "rows": rows,
                                           "stream_gbps_after": stream, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
                                          indent=2) + "\n")


if __name__ == "__main__":
    main()
