"""The one-row matmul kernel with other values of `matmul.cc`'s constants, timed in one process, alternating.

    python scripts/bench_kernel_variants.py --variant built: --variant g4:kRowGroupNarrow=4,kRowGroupWide=4 \
        --variant p16:kRowPrefetchRows=16 --model small --rounds 60 --out reports/kernel_variants.json
    git show REV:jaxserve/kernels/cpu/matmul.cc > /tmp/old.cc
    python scripts/bench_kernel_variants.py --head --variant old:@/tmp/old.cc --variant new:

Each `--variant NAME:[@PATH,][CONST=VALUE,...]` is `matmul.cc` (or the file at PATH, e.g. another revision's) with
those `constexpr int` constants replaced, built into its own library (the build flags of `cpu_kernels`) whose
`x @ w` and `x @ w^T` handlers are registered under FFI targets of its own, so that all variants run side by side
in this process and see the same states of the machine (its bandwidth moved 40-76 GB/s within minutes on the
2-core EPYC; separate processes compared those states, not the variants). The workload: `--model`'s projections
(qkv, o, gate/up, down) at one row, each layer's weights fresh (`--layers` sets of them, so that they come from
memory as a step's do), chained one into the next in one jitted call, `--row-parts` parts a row; with `--head`,
the tied LM head at one row over `--layers` copies of the embedding, cycled. Per variant: the median time, the
weight bandwidth, and the median of its per-round ratios to the first variant.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
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


def parse_variant(text: str) -> tuple[str, Path | None, dict[str, int]]:
    """NAME:[@PATH,]CONST=VALUE,... -> (name, another matmul.cc or None, {const: value}); ValueError else."""
    name, _, spec = text.partition(":")
    if not re.fullmatch(r"\w+", name):
        raise ValueError(f"--variant {text!r}: NAME:[@PATH,][CONST=VALUE,...] (NAME a word)")
    source, consts = None, {}
    for item in filter(None, spec.split(",")):
        if item.startswith("@"):
            source = Path(item[1:])
            if not source.is_file():
                raise ValueError(f"--variant {text!r}: no file {source}")
            continue
        const, _, value = item.partition("=")
        if not re.fullmatch(r"k\w+", const) or not re.fullmatch(r"\d+", value):
            raise ValueError(f"--variant {text!r}: {item!r} is not CONST=INTEGER or @PATH")
        consts[const] = int(value)
    return name, source, consts


def variant_source(name: str, source: Path | None, consts: dict[str, int]) -> str:
    """`source` (default: the working tree's `matmul.cc`) with `consts` replaced and its x @ w and x @ w^T handlers
    renamed for `name`."""
    src = (source or SOURCE).read_text()
    for const, value in consts.items():
        src, n = re.subn(rf"constexpr int {const} = \d+;", f"constexpr int {const} = {value};", src)
        if n != 1:
            raise ValueError(f"{(source or SOURCE).name} has no `constexpr int {const} = ...;`")
    handler = "XLA_FFI_DEFINE_HANDLER_SYMBOL("
    src = src.replace(f"{handler}JaxserveMatmulNT,", f"{handler}VariantNT_{name},")
    return src.replace(f"{handler}JaxserveMatmul,", f"{handler}Variant_{name},")


def build_variant(name: str, source: Path | None, consts: dict[str, int], folder: Path) -> tuple[str, str]:
    """Build the variant into `folder` and register it; returns its FFI targets (x @ w, x @ w^T)."""
    src = folder / f"matmul_{name}.cc"
    src.write_text(variant_source(name, source, consts))
    lib = folder / f"matmul_{name}.so"
    include = [f"-I{SOURCE.parent}", f"-I{jax.ffi.include_dir()}"]
    run = subprocess.run([cpu_kernels._compiler(), *cpu_kernels.FLAGS, *include, str(src), "-o", str(lib)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"variant {name} did not build: {run.stderr.strip().splitlines()[-1]}")
    loaded = ctypes.cdll.LoadLibrary(str(lib))
    targets = (f"jaxserve_bench_variant_{name}", f"jaxserve_bench_variant_nt_{name}")
    for target, symbol in zip(targets, (f"Variant_{name}", f"VariantNT_{name}"), strict=True):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(loaded, symbol)), platform="cpu")
    return targets


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


def head(target: str):
    """The tied LM head at one row: x @ w^T over the embedding [vocab, hidden] as it lies in memory."""
    return jax.jit(lambda x, w: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((1, w.shape[0]), jnp.float32))(x, w))


def cycling(f, x: jax.Array, weights: list[jax.Array]):
    """A call of f(x, w) on the next of `weights` each time (each read from memory, not from the last call's cache)."""
    ws = itertools.cycle(weights)
    return lambda: f(x, next(ws))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME:[@PATH,][CONST=VALUE,...]: matmul.cc (or the file at PATH) with those constants")
    ap.add_argument("--head", action="store_true",
                    help="time the tied LM head x @ w^T at one row (the embedding) instead of the projections")
    ap.add_argument("--model", default="small")
    ap.add_argument("--layers", type=int, default=12,
                    help="sets of fresh weights (default: small's 12 layers; with --head, embedding copies cycled)")
    ap.add_argument("--row-parts", type=int, default=0, help="parts one row cuts a weight into (0: the default)")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    try:
        variants = {name: (source, consts) for name, source, consts in map(parse_variant, a.variant)}
        for name, (source, consts) in variants.items():
            variant_source(name, source, consts)
    except ValueError as e:
        ap.error(str(e))
    if not cpu_kernels.available():
        print("error: jaxserve's CPU kernels are not available on this machine", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory(prefix="jaxserve-kernel-variants-") as folder:
        targets = {name: build_variant(name, *spec, Path(folder)) for name, spec in variants.items()}
    spec = load_model_spec(a.model)
    if a.head:
        runs = {name: head(nt) for name, (_, nt) in targets.items()}
        weights = [jnp.full((spec.vocab_size, spec.hidden_size), 1e-3 + i * 1e-6, jnp.float32)
                   for i in range(a.layers)]
        x = jnp.ones((1, spec.hidden_size), jnp.float32)
        nbytes = weights[0].size * 4
        calls = {name: cycling(f, x, weights) for name, f in runs.items()}
    else:
        runs = {name: chained(mm, a.row_parts) for name, (mm, _) in targets.items()}
        shapes = projection_shapes(a.model)
        layers = [[jnp.full(s, 1e-3 + i * 1e-6, jnp.float32) for s in shapes] for i in range(a.layers)]
        x = jnp.ones((1, shapes[0][0]), jnp.float32)
        nbytes = sum(w.size * 4 for layer in layers for w in layer)
        calls = {name: (lambda f=f: f(x, layers)) for name, f in runs.items()}
    for call in calls.values():
        jax.block_until_ready(call())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(a.rounds):
        for name in (list(calls) if i % 2 else list(calls)[::-1]):
            t = time.perf_counter()
            jax.block_until_ready(calls[name]())
            times[name].append(time.perf_counter() - t)
    first = next(iter(calls))
    rows = [{"variant": name, "source": str(variants[name][0] or SOURCE), "constants": variants[name][1],
             "ms": 1e3 * statistics.median(ts), "weight_gbps": nbytes / statistics.median(ts) / 1e9,
             "ratio_to_first": statistics.median(t / b for t, b in zip(ts, times[first], strict=True))}
            for name, ts in times.items()]
    for row in rows:
        print(f"{row['variant']:>12}: {row['ms']:.3f} ms, {row['weight_gbps']:.1f} GB/s, "
              f"{row['ratio_to_first']:.3f}x {first}", flush=True)
    stream = measure_bandwidth(1 << 30) / 1e9
    print(f"streaming sum after: {stream:.1f} GB/s")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"model": a.model, "workload": "head" if a.head else "projections",
                                           "layers": a.layers, "row_parts": a.row_parts, "rounds": a.rounds,
                                           "weight_mb": nbytes / 1e6, "rows": rows, "stream_gbps_after": stream,
                                           "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
