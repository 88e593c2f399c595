"""GPU microbenchmarks of the decode step's kernels (issues 41 and 42): split-KV decode attention, few-row matmuls.

    scripts/gpu_kernels.sh [OUT_DIR]                                    # one H200, bare checkout: under 2 minutes
    PYTHONPATH=. python3 scripts/gpu_kernels.py --cpu-smoke [OUT_DIR]   # tiny shapes on a CPU, kernels interpreted

Needs jax (with CUDA) and numpy; imports no engine, no flax. Three parts, each recorded even when another fails:
1. copy: the device-to-device copy bandwidth of a 1 GiB buffer (bytes read + written over time), the yardstick;
2. attention: one layer of decode attention at 1k tokens of context for 1 and 8 decodes with synthetic-1b's heads
   in bf16 pages of 16 tokens: the split-KV backend's decode-only variant (its chosen split count, a quarter of
   it, and 32-key blocks), the ragged kernel and the jnp reference (its accelerator tuning); each one's max abs
   error against the reference. Targets: <= 6 us a layer for one decode, <= 10 us for eight;
3. matmul: each projection of synthetic-1b's and llama-3.1-8b's layer (fused qkv, o, fused gate_up, down) at 1,
   8 and 16 rows with bf16, int8 and fp8 weights: the matvec kernel and XLA's dot (`quantize.quantized_matmul`
   for codes), their time, GB/s of weights read and share of the copy bandwidth (target >= 80%), and the kernels
   XLA ran at one row (a reduce fusion or a GEMM); synthetic-1b's also with other tiles at one row (half and
   twice the K split, the other column width), for the first GPU runs to tune `matvec_tiles` from.
Every timing runs its op on several layers' distinct data in one jit (together more than the L2 cache, dispatch
amortised, per-layer prep included as the model pays it), median of `reps` calls, per layer. All of a group's
variants are compiled at once on a thread pool. Writes gpu_kernels.json and gpu_kernels.md into OUT_DIR (default:
$OUT if set, else out/gpu_kernels).
"""

from __future__ import annotations

import functools
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import begin, finish, guarded, median_time  # noqa: E402

from jaxserve.kernels.gpu.matvec import MatvecTiles, matvec, matvec_refusal, matvec_tiles  # noqa: E402
from jaxserve.kernels.gpu.ragged_paged_attention import PallasAttention  # noqa: E402
from jaxserve.kernels.gpu.split_kv_decode import SplitKvAttention, split_kv_step_attention  # noqa: E402
from jaxserve.kernels.metadata import AttentionMetadata  # noqa: E402
from jaxserve.model.attention.reference import ACCELERATOR_TUNING  # noqa: E402
from jaxserve.model.quantize import QuantizedWeight, quantized_matmul  # noqa: E402
from modelspec.spec import PRESETS  # noqa: E402


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the GPU's, or the CPU smoke test's."""

    attention_model: str = "synthetic-1b"
    matmul_models: tuple[str, ...] = ("synthetic-1b", "llama-3.1-8b")
    dtype: str = "bfloat16"
    page_size: int = 16
    context: int = 1024
    decodes: tuple[int, ...] = (1, 8)
    max_model_len: int = 4096  # the page table's width, as the runner pads it
    rows: tuple[int, ...] = (1, 8, 16)
    projections: tuple[str, ...] = ("qkv", "o", "gate_up", "down")
    sweep_rows: int = 1  # the first model's kernels also run other tiles at this many rows (0: none)
    kinds: tuple[str, ...] = ("float", "int8", "fp8")  # "float": weights in `dtype`
    reps: int = 20
    bytes_per_call: int = 128 * 2**20  # each timed call reads about this much (L2: 50 MB on an H200)
    max_copies: int = 32
    copy_bytes: int = 2**30
    interpret: bool = False


SMOKE = Plan(attention_model="tiny", matmul_models=("tiny",), dtype="float32", context=48, decodes=(2,),
             max_model_len=128, rows=(3,), projections=("qkv", "down"), sweep_rows=3, reps=2, bytes_per_call=64 * 2**10,
             max_copies=2, copy_bytes=4 * 2**20, interpret=True)
TARGET_US = {1: 6.0, 8: 10.0}  # decode attention a layer at 1k context (issue 41)
TARGET_OF_COPY = 0.8  # few-row matmuls read weights at >= 80% of the copy bandwidth (issue 41 item 3)


def copies_for(nbytes: int, plan: Plan) -> int:
    return int(min(plan.max_copies, max(2, -(-plan.bytes_per_call // max(1, nbytes)))))


def compile_all(jobs: dict[str, tuple[Any, tuple]]) -> dict[str, Any]:
    """name -> (fn, args): each jitted, lowered and compiled, on a thread pool (XLA's and Triton's compiles run
    in parallel); a failed compile becomes its exception."""
    def one(item):
        name, (fn, args) = item
        try:
            return name, jax.jit(fn).lower(*args).compile()
        except Exception as e:
            return name, e

    with ThreadPoolExecutor(8) as pool:
        return dict(pool.map(one, jobs.items()))


def copy_part(plan: Plan, log) -> dict[str, Any]:
    x = jnp.ones(plan.copy_bytes // 2, jnp.bfloat16)
    add = jax.jit(lambda a: a + 1)
    seconds = median_time(lambda: add(x), plan.reps)
    gbps = 2 * x.nbytes / seconds / 1e9
    log(f"copy: {x.nbytes / 2**20:.0f} MiB in {seconds * 1e6:.0f} us, {gbps:.0f} GB/s (read + write)")
    return {"bytes": x.nbytes, "us": seconds * 1e6, "gbps": gbps}


def decode_case(plan: Plan, n: int, layers: int, key) -> tuple:
    """q [n, H, D], `layers` distinct K and V pools (each just the pages of n decodes at `context`), and the
    decode-only metadata the runner would build (pages shuffled, table `max_model_len` wide)."""
    spec = PRESETS[plan.attention_model]
    ps, dtype = plan.page_size, jnp.dtype(plan.dtype)
    per_seq = -(-plan.context // ps)
    rng = np.random.default_rng(0)
    table = np.zeros((n, plan.max_model_len // ps), np.int32)
    table[:, :per_seq] = rng.permutation(np.arange(1, 1 + n * per_seq)).reshape(n, per_seq)
    meta = AttentionMetadata(slot_mapping=jnp.zeros(n, jnp.int32), cu_q_lens=jnp.arange(n + 1, dtype=jnp.int32),
                             kv_lens=jnp.full(n, plan.context, jnp.int32), page_table=jnp.asarray(table),
                             num_seqs=jnp.int32(n), num_decodes=jnp.int32(n))
    shape = (1 + n * per_seq, ps, spec.num_kv_heads, spec.head_dim)
    keys = jax.random.split(key, 2 * layers + 1)
    make = jax.jit(lambda k: jax.random.normal(k, shape, dtype))
    pools = [make(k) for k in keys[1:]]
    q = jax.random.normal(keys[0], (n, spec.num_heads, spec.head_dim), dtype)
    return q, pools[:layers], pools[layers:], meta


def attention_case(plan: Plan, n: int, log) -> dict[str, Any]:
    """One decode count: every backend over `layers` layers' pools, timed and checked against the reference."""
    spec = PRESETS[plan.attention_model]
    scale = spec.head_dim**-0.5
    kv_bytes = 2 * n * plan.context * spec.num_kv_heads * spec.head_dim * jnp.dtype(plan.dtype).itemsize
    layers = copies_for(kv_bytes, plan)
    args = decode_case(plan, n, layers, jax.random.key(n))
    auto = SplitKvAttention(decode_only=True, interpret=plan.interpret)
    s = auto.splits_for(n, spec.num_kv_heads, args[3].page_table.shape, plan.page_size)
    step = functools.partial(split_kv_step_attention, decode_only=True, interpret=plan.interpret)
    backends = {f"split auto (s={s}, bk64)": auto,
                f"split s={max(1, s // 4)} bk64": functools.partial(step, splits=max(1, s // 4)),
                f"split s={s} bk32": functools.partial(step, splits=s, kv_block=32),
                "ragged kernel": PallasAttention(interpret=plan.interpret),
                "jnp reference": ACCELERATOR_TUNING}

    def all_layers(attend):
        def run(q, ks, vs, meta):
            return jnp.stack([attend(q, k, v, meta, scale) for k, v in zip(ks, vs, strict=True)])
        return run

    compiled = compile_all({name: (all_layers(b), args) for name, b in backends.items()})
    case: dict[str, Any] = {"layers_per_call": layers, "kv_bytes_per_layer": kv_bytes, "splits_auto": s,
                            "target_us": TARGET_US.get(n)}
    ref = compiled["jnp reference"]
    ref = None if isinstance(ref, Exception) else ref(*args).astype(jnp.float32)
    for name, fn in compiled.items():
        if isinstance(fn, Exception):
            case[name] = {"error": f"{type(fn).__name__}: {fn}"}
            continue
        seconds = median_time(functools.partial(fn, *args), plan.reps) / layers
        case[name] = {"us_per_layer": seconds * 1e6, "kv_gbps": kv_bytes / seconds / 1e9}
        if ref is not None:
            case[name]["max_abs_error"] = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - ref)))
    log(f"attention, {n} decode(s) x {plan.context}: " + ", ".join(
        f"{k} {v['us_per_layer']:.1f} us" for k, v in case.items() if isinstance(v, dict) and "us_per_layer" in v))
    return case


def attention_part(plan: Plan, log) -> dict[str, Any]:
    return {f"{n} x {plan.context}": attention_case(plan, n, log) for n in plan.decodes}


def projections(model: str) -> dict[str, tuple[int, int]]:
    """(K, N) of each projection of one layer, as the model stores them (qkv and gate_up fused)."""
    s = PRESETS[model]
    return {"qkv": (s.hidden_size, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim),
            "o": (s.num_heads * s.head_dim, s.hidden_size),
            "gate_up": (s.hidden_size, 2 * s.intermediate_size), "down": (s.intermediate_size, s.hidden_size)}


def make_weights(k: int, n: int, kind: str, dtype: jnp.dtype, copies: int, key) -> tuple[list, list | None]:
    """`copies` distinct random weights [k, n] of `kind` (codes with scales [n] for int8 / fp8)."""
    if kind == "float":
        make = jax.jit(lambda key: (jax.random.normal(key, (k, n), jnp.float32) * k**-0.5).astype(dtype))
    elif kind == "int8":
        make = jax.jit(lambda key: jax.random.randint(key, (k, n), -127, 128, jnp.int8))
    else:
        make = jax.jit(lambda key: (jax.random.normal(key, (k, n), jnp.float32) * 64).astype(jnp.float8_e4m3fn))
    ws = [make(c) for c in jax.random.split(key, copies)]
    scales = None if kind == "float" else [jnp.full((n,), 0.01 / k**0.5, jnp.float32) for _ in ws]
    return ws, scales


def xla_kinds(compiled) -> list[str]:
    """The fusions and library calls XLA compiled a product to (e.g. input_reduce_fusion vs gemm_fusion_dot)."""
    text = compiled.as_text()
    names = set(re.findall(r"%([a-z_]*(?:fusion|gemm|dot)[a-z_]*)", text))
    return sorted(names | set(re.findall(r'custom_call_target="([^"]+)"', text)))[:12]


def other_tiles(tiles: MatvecTiles, k: int) -> dict[str, MatvecTiles]:
    """Tiles beside the chosen ones, for the first GPU runs to choose from: half and twice the K split (where K
    has the tiles for it), the other column width."""
    alts = (replace(tiles, split_k=max(1, tiles.split_k // 2)), replace(tiles, split_k=min(16, 2 * tiles.split_k)),
            replace(tiles, block_n=64 if tiles.block_n == 128 else 128))
    return {f"n{t.block_n} k{t.block_k} s{t.split_k}": t for t in alts if t != tiles and k >= t.block_k * t.split_k}


def matmul_group(plan: Plan, k: int, n: int, kind: str, copy_gbps: float | None, key, sweep: bool = False
                 ) -> dict[str, Any]:
    """One projection shape and weight kind at every row count: kernel and XLA, per weight copy; with `sweep`,
    other tiles too at `plan.sweep_rows` rows."""
    dtype = jnp.dtype(plan.dtype)
    w_dtype = dtype if kind == "float" else jnp.dtype(jnp.int8 if kind == "int8" else jnp.float8_e4m3fn)
    w_bytes = k * n * w_dtype.itemsize + (0 if kind == "float" else 4 * n)
    copies = copies_for(w_bytes, plan)
    ws, scales = make_weights(k, n, kind, dtype, copies, key)

    def kernel(x, ws, scales, tiles=None):
        return [matvec(x, w, None if scales is None else scales[i], tiles=tiles, interpret=plan.interpret)
                for i, w in enumerate(ws)]

    def xla(x, ws, scales):
        if scales is None:
            return [jnp.dot(x, w) for w in ws]
        return [quantized_matmul(x, QuantizedWeight(w, s)) for w, s in zip(ws, scales, strict=True)]

    xs = {t: jax.random.normal(jax.random.key(t), (t, k), jnp.float32).astype(dtype) for t in plan.rows}
    jobs = {(impl, t): (f, (xs[t], ws, scales)) for t in plan.rows for impl, f in (("kernel", kernel), ("xla", xla))
            if impl == "xla" or matvec_refusal(t, k, n, dtype, w_dtype) is None}
    t_sweep = plan.sweep_rows if sweep and plan.sweep_rows in xs else None
    alts = other_tiles(matvec_tiles(k, n, w_dtype), k) if t_sweep else {}
    jobs.update({(f"kernel {name}", t_sweep): (functools.partial(kernel, tiles=tiles), (xs[t_sweep], ws, scales))
                 for name, tiles in alts.items()})
    compiled = compile_all(jobs)
    out: dict[str, Any] = {"K": k, "N": n, "weight_bytes": w_bytes, "copies": copies,
                           "tiles": asdict(matvec_tiles(k, n, w_dtype))}
    for t in plan.rows:
        r: dict[str, Any] = {}
        for impl in ("kernel", "xla"):
            fn = compiled.get((impl, t))
            if fn is None or isinstance(fn, Exception):
                r[impl] = {"error": f"{type(fn).__name__}: {fn}" if fn is not None else "refused"}
                continue
            seconds = median_time(functools.partial(fn, xs[t], ws, scales), plan.reps) / copies
            r[impl] = {"us": seconds * 1e6, "gbps": w_bytes / seconds / 1e9}
            if copy_gbps:
                r[impl]["of_copy"] = r[impl]["gbps"] / copy_gbps
        if all("us" in r.get(i, {}) for i in ("kernel", "xla")):
            a, b = (np.asarray(compiled[(i, t)](xs[t], ws, scales)[0], np.float32) for i in ("kernel", "xla"))
            r["max_rel_error"] = float(np.max(np.abs(a - b)) / max(1e-30, float(np.max(np.abs(b)))))
        if t == plan.rows[0] and not isinstance(compiled.get(("xla", t)), Exception):
            r["xla_kernels"] = xla_kinds(compiled[("xla", t)])
        if t == t_sweep:
            r["other_tiles_us"] = {name: str(fn) if isinstance(fn, Exception) else
                                   1e6 * median_time(functools.partial(fn, xs[t], ws, scales), plan.reps) / copies
                                   for name in alts for fn in (compiled[(f"kernel {name}", t)],)}
        out[f"rows {t}"] = r
    return out


def matmul_part(plan: Plan, log, copy_gbps: float | None, budget_s: float, t0: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    key = jax.random.key(7)
    for model in plan.matmul_models:
        for proj in plan.projections:
            k, n = projections(model)[proj]
            for kind in plan.kinds:
                label = f"{model} {proj} {kind}"
                if time.perf_counter() - t0 > budget_s:
                    out[label] = {"skipped": f"past the {budget_s:.0f} s budget"}
                    continue
                key, sub = jax.random.split(key)
                out[label] = guarded(functools.partial(matmul_group, plan, k, n, kind, copy_gbps, sub,
                                                       sweep=model == plan.matmul_models[0]), log)
                log(f"{label} [{k} x {n}]: " + "; ".join(
                    f"{rows} " + ", ".join(f"{i} {v[i]['us']:.1f} us" for i in ("kernel", "xla")
                                           if "us" in v.get(i, {}))
                    for rows, v in out[label].items() if rows.startswith("rows")))
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# gpu_kernels: {report['device']} ({report['jax']})", "",
             f"elapsed {report['elapsed_s']:.0f} s; copy bandwidth {report['copy'].get('gbps', float('nan')):.0f} GB/s "
             "(read + write)", "", "## Decode attention, one layer", "",
             "| case | backend | us a layer | KV GB/s | max abs error | target |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for case, c in report.get("attention", {}).items():
        for name, r in c.items():
            if not isinstance(r, dict):
                continue
            if "us_per_layer" not in r:
                lines.append(f"| {case} | {name} | {r} | | | |")
                continue
            target = c.get("target_us")
            meets = "" if target is None else ("meets" if r["us_per_layer"] <= target else "misses") + f" {target} us"
            lines.append(f"| {case} | {name} | {r['us_per_layer']:.2f} | {r['kv_gbps']:.0f} | "
                         f"{r.get('max_abs_error', float('nan')):.3g} | {meets} |")
    lines += ["", "## Few-row matmuls (per projection; share of the copy bandwidth, target "
              f"{TARGET_OF_COPY:.0%})", "",
              "| projection | rows | kernel us | GB/s | of copy | XLA us | GB/s | of copy | XLA at one row |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    sweeps = []
    for label, g in report.get("matmul", {}).items():
        for rows, r in g.items():
            if not rows.startswith("rows"):
                continue
            if "other_tiles_us" in r:
                chosen = r.get("kernel", {}).get("us", float("nan"))
                sweeps.append(f"- {label}, {rows}: chosen {g['tiles']} {chosen:.1f} us; " + ", ".join(
                    f"{name} {us:.1f} us" if isinstance(us, float) else f"{name} {us}"
                    for name, us in r["other_tiles_us"].items()))
            cells = []
            for impl in ("kernel", "xla"):
                v = r.get(impl, {})
                cells += ([f"{v['us']:.1f}", f"{v['gbps']:.0f}", f"{v.get('of_copy', float('nan')):.0%}"]
                          if "us" in v else [str(v.get("error", "")), "", ""])
            xla_kernels = " ".join(r.get("xla_kernels", []))
            lines.append(f"| {label} | {rows[5:]} | " + " | ".join(cells) + f" | {xla_kernels} |")
        if "error" in g or "skipped" in g:
            lines.append(f"| {label} | | {g.get('error') or g.get('skipped')} | | | | | | |")
    if sweeps:
        lines += ["", "Other tiles of the kernel:", "", *sweeps]
    if report.get("failed"):
        lines += ["", f"failed parts: {', '.join(report['failed'])}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    args, out, log, t0 = begin(__doc__.splitlines()[0], "out/gpu_kernels", 100.0)
    plan = SMOKE if args.cpu_smoke else Plan()
    device = jax.devices()[0]
    report: dict[str, Any] = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
                              "plan": asdict(plan)}
    report["copy"] = guarded(lambda: copy_part(plan, log), log)
    report["attention"] = guarded(lambda: attention_part(plan, log), log)
    report["matmul"] = guarded(lambda: matmul_part(plan, log, report["copy"].get("gbps"), args.budget_s, t0), log)
    report["failed"] = [name for name in ("copy", "attention", "matmul") if "error" in report[name]]
    report["failed"] += [label for label, g in report["matmul"].items() if isinstance(g, dict) and "error" in g]
    finish(out, "gpu_kernels", report, markdown, log, t0)


if __name__ == "__main__":
    main()
