"""One prepared GPU run of the accelerator step (issue 25): the Pallas attention kernel and whole engine steps.

    scripts/gpu_step.sh [OUT_DIR]                # on one H200, from a bare checkout: well under 6 minutes
    PYTHONPATH=. python3 scripts/gpu_step.py --cpu-smoke [OUT_DIR]   # the same run end to end on a CPU, tiny

Needs jax (with CUDA), flax, numpy and click; no torch, no transformers, no network. Three parts, each timed and
recorded even when another fails:
1. kernel: the Pallas kernel against the jnp reference (its accelerator tuning) on the device, on a mixed ragged
   step in bfloat16 and float32 (max abs error), and both timed per layer on an 8 x 1k-context decode and a
   2048-token prefill;
2. engine: `synthetic-1b` in bfloat16 through `LLMEngine` with the Pallas backend: a one-request decode step, an
   8-request decode step (1k context) and a 2048-token prefill step, each with its MBU (bytes the step reads, as
   the planner counts them, over time over HBM bandwidth) or MFU (FLOPs over time over the bf16 peak);
3. forward: the one-request decode's jitted forward alone, with the Pallas backend and with the reference (whose
   loops wait on the host every iteration on a GPU).
Writes gpu_step.json and gpu_step.md into OUT_DIR (default: $OUT if set, else out/gpu_step).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from gpu_common import begin, finish, guarded, median_time

from jaxserve.config.engine import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.kernels.gpu.ragged_paged_attention import PallasAttention
from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.model.attention.reference import ACCELERATOR_TUNING, CPU_TUNING
from jaxserve.runner.buckets import bucket_for
from modelspec.memory import weight_bytes_per_device
from modelspec.spec import PRESETS
from planner.hardware import load_hardware
from planner.step_model import decode_shape, op_costs, prefill_shape


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the GPU's, or the CPU smoke test's."""

    model: str = "synthetic-1b"
    dtype: str = "bfloat16"
    page_size: int = 16
    decode_context: int = 1024
    prefill_len: int = 2048
    steps: int = 50
    reps: int = 4
    kv_bytes: int = 2 * 2**30
    max_model_len: int = 4096
    interpret: bool = False


SMOKE = Plan(model="tiny", dtype="float32", decode_context=48, prefill_len=64, steps=3, reps=2,
             kv_bytes=8 * 2**20, max_model_len=256, interpret=True)


def ragged_case(rng, plan: Plan, heads: int, kv_heads: int, head_dim: int, decodes: list[int],
                prefills: list[tuple[int, int]], dtype) -> tuple:
    """(q, k_cache, v_cache, meta) for decodes (contexts) then prefill chunks (q_len, prior context), padded to a
    power-of-two token count and 16 sequences, pages shuffled over a pool that just holds them."""
    ps = plan.page_size
    q_lens = [1] * len(decodes) + [q for q, _ in prefills]
    kv_lens = list(decodes) + [q + c for q, c in prefills]
    t, s = 1 << max(0, sum(q_lens) - 1).bit_length(), 16
    width = -(-max(kv_lens) // ps)
    need = [-(-n // ps) for n in kv_lens]
    pages = rng.permutation(np.arange(1, sum(need) + 1))
    table = np.zeros((s, width), np.int32)
    cu = np.full(s + 1, sum(q_lens), np.int32)
    cu[: len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv = np.zeros(s, np.int32)
    kv[: len(kv_lens)] = kv_lens
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = pages[used : used + n]
        used += n
    meta = AttentionMetadata(slot_mapping=jnp.zeros(t, jnp.int32), cu_q_lens=jnp.asarray(cu),
                             kv_lens=jnp.asarray(kv), page_table=jnp.asarray(table),
                             num_seqs=jnp.int32(len(q_lens)), num_decodes=jnp.int32(len(decodes)))
    shape = (sum(need) + 1, ps, kv_heads, head_dim)
    q = jnp.asarray(rng.standard_normal((t, heads, head_dim), dtype=np.float32), dtype)
    k = jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)
    return q, k, v, meta, sum(q_lens)


def kernel_part(plan: Plan, log) -> dict[str, Any]:
    """The kernel against the reference (errors), then both timed per layer."""
    spec = PRESETS[plan.model]
    h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    scale = d**-0.5
    pallas = PallasAttention(interpret=plan.interpret)
    reference = CPU_TUNING if plan.interpret else ACCELERATOR_TUNING
    run = {name: jax.jit(functools.partial(b, scale=scale)) for name, b in (("pallas", pallas),
                                                                             ("reference", reference))}
    rng = np.random.default_rng(0)
    c = plan.decode_context
    mixed = ([1, 17, c // 3, c, 2 * c - 1], [(plan.prefill_len // 4, 0), (plan.prefill_len // 16, c - 24)])
    out: dict[str, Any] = {"errors": {}, "ms_per_layer": {}}
    for dtype in (jnp.bfloat16, jnp.float32):
        q, k, v, meta, n = ragged_case(rng, plan, h, kvh, d, *mixed, dtype)
        a, b = (np.asarray(run[name](q, k, v, meta).astype(jnp.float32))[:n] for name in ("pallas", "reference"))
        out["errors"][jnp.dtype(dtype).name] = float(np.max(np.abs(a - b)))
        log(f"kernel vs reference, {jnp.dtype(dtype).name}: max abs error {out['errors'][jnp.dtype(dtype).name]:.3g}")
    dtype = jnp.dtype(plan.dtype)
    # A few of the kernel's tunings beside the default (block_q, kv_block, num_warps), for the first GPU runs.
    tunings = {} if plan.interpret else {f"pallas bq{bq} bk{bk} w{w}": jax.jit(functools.partial(
        PallasAttention(block_q=bq, kv_block=bk, num_warps=w), scale=scale))
        for bq, bk, w in ((32, 64, 4), (16, 128, 4), (32, 128, 8))}
    for label, case in ((f"decode 8 x {c}", ([c] * 8, [])), (f"prefill {plan.prefill_len}",
                                                             ([], [(plan.prefill_len, 0)]))):
        q, k, v, meta, _ = ragged_case(rng, plan, h, kvh, d, *case, dtype)
        reps = 10 if plan.interpret else 50
        out["ms_per_layer"][label] = {name: 1e3 * median_time(functools.partial(f, q, k, v, meta), reps)
                                      for name, f in (*run.items(), *tunings.items())}
        log(f"{label}: {out['ms_per_layer'][label]}")
    return out


def step_cost(plan: Plan, shape, padded: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one step of `shape` padded to `padded` tokens, as the planner counts them."""
    ops = op_costs(PRESETS[plan.model], shape, dtype="fp32" if plan.dtype == "float32" else "bf16",
                   padded_tokens=padded)
    return (sum(o.count * (o.weight_bytes + o.kv_bytes + o.act_bytes) for o in ops),
            sum(o.count * o.flops for o in ops))


def to_decoding(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> list[str]:
    """Add the prompts and step until every one of them decodes; returns their request ids."""
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    engine.step()
    while engine.last_step.num_prefill_tokens or engine.last_step.num_decode_tokens < len(ids):
        engine.step()
    for _ in range(3):
        engine.step()
    return ids


def decode_steps(engine: LLMEngine, plan: Plan, batch: int, hw) -> dict[str, Any]:
    """Median engine step of `batch` decoding requests at ~decode_context tokens of context, and its MBU."""
    params = SamplingParams(temperature=0, max_tokens=plan.steps + 16, ignore_eos=True)
    prompts = [[(7 * i + j) % 200 + 1 for j in range(plan.decode_context)] for i in range(batch)]
    ids = to_decoding(engine, prompts, params, f"d{batch}-")
    compiles = engine.runner.compile_count()
    times, contexts = [], []
    for _ in range(plan.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        contexts.append(engine.last_step.decode_context_tokens / max(1, engine.last_step.num_decode_tokens))
    for rid in ids:
        engine.abort_request(rid)
    step = float(np.median(times))
    nbytes, _ = step_cost(plan, decode_shape(batch, float(np.mean(contexts)) - 1),
                          bucket_for(batch, engine.runner.token_buckets))
    return {"step_ms": 1e3 * step, "mean_ms": 1e3 * float(np.mean(times)), "context": float(np.mean(contexts)),
            "bytes": nbytes, "mbu": nbytes / step / hw.memory_bw,
            "compiled_while_timed": engine.runner.compile_count() > compiles}


def prefill_steps(engine: LLMEngine, plan: Plan, hw) -> dict[str, Any]:
    """Median engine step that prefills a fresh `prefill_len`-token prompt (and draws its one token), and its MFU."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(plan.reps + 1):  # the first, untimed, runs the bucket once
        engine.add_request(f"p{r}", [(13 * r + j) % 250 + 1 for j in range(plan.prefill_len)], params)
        t = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t
        assert engine.last_step.num_prefill_tokens == plan.prefill_len, engine.last_step
        times.append(elapsed)
        while engine.has_unfinished_requests():
            engine.step()
    step = float(np.median(times[1:]))
    nbytes, flops = step_cost(plan, prefill_shape(plan.prefill_len), plan.prefill_len)
    dtype = "fp32" if plan.dtype == "float32" else "bf16"
    return {"step_ms": 1e3 * step, "flops": flops, "mfu": flops / step / hw.peak(dtype),
            "mbu": nbytes / step / hw.memory_bw}


def forward_part(engine: LLMEngine, plan: Plan) -> dict[str, float]:
    """The one-request decode's jitted forward alone: the engine's backend, then the reference's (re-jitted)."""
    params = SamplingParams(temperature=0, max_tokens=plan.steps + 16, ignore_eos=True)
    to_decoding(engine, [[j % 200 + 1 for j in range(plan.decode_context)]], params, "f")
    runner = engine.runner
    batch = engine.scheduler.schedule()  # the last act on this engine: the step is laid out, never run
    t = bucket_for(batch.num_tokens, runner.token_buckets)
    packed = runner.device_inputs(batch, t)
    out = {}
    chosen = runner.policy
    reference = CPU_TUNING if plan.interpret else ACCELERATOR_TUNING
    for name, backend in ((chosen.ops.attention.name, chosen.ops.attention), ("reference", reference)):
        # read when the forward is traced: a fresh jit for each backend
        runner.policy = dataclasses.replace(chosen, ops=dataclasses.replace(chosen.ops, attention=backend))
        fwd = runner.forward_fn(t, fresh=True)

        def call(fwd=fwd):
            hidden, runner.kv_caches = fwd(runner.param_leaves, runner.kv_caches, packed, runner.no_prev)
            return hidden

        out[f"{name}_ms"] = 1e3 * median_time(call, plan.steps)
    runner.policy = chosen
    return out


def engine_part(plan: Plan, log, budget_s: float, t0: float) -> dict[str, Any]:
    hw = load_hardware("cpu" if plan.interpret else _gpu_name())
    t = time.perf_counter()
    p = plan.prefill_len
    config = functools.partial(
        EngineConfig, model=plan.model, dtype=plan.dtype, max_num_seqs=8, max_num_batched_tokens=p, chunk_size=p,
        page_size=plan.page_size, kv_cache_memory=plan.kv_bytes, max_model_len=plan.max_model_len,
        enable_prefix_caching=False, token_buckets=(1, 8, p), seq_buckets=(1, 8))
    out: dict[str, Any] = {}
    try:
        engine = LLMEngine(config(attention_backend="pallas"))
    except Exception as e:  # refused, or the kernel failed to compile: the steps still get measured
        log(traceback.format_exc())
        out["pallas_error"] = f"{type(e).__name__}: {e}"
        engine = LLMEngine(config(attention_backend="reference"))
    spec = PRESETS[plan.model]
    dtype = "fp32" if plan.dtype == "float32" else "bf16"
    out.update(backend=engine.config.attention_backend, hardware=hw.name, build_and_warmup_s=time.perf_counter() - t,
               weight_floor_ms=1e3 * weight_bytes_per_device(spec, dtype) / hw.memory_bw)
    log(f"engine ready ({out['backend']}) in {out['build_and_warmup_s']:.1f} s")
    for name, fn in (("decode_1", lambda: decode_steps(engine, plan, 1, hw)),
                     ("decode_8", lambda: decode_steps(engine, plan, 8, hw)),
                     ("prefill", lambda: prefill_steps(engine, plan, hw)),
                     ("forward_decode_1", lambda: forward_part(engine, plan))):
        if time.perf_counter() - t0 > budget_s:
            out[name] = {"skipped": f"past the {budget_s:.0f} s budget"}
            continue
        out[name] = guarded(fn, log)
        log(f"{name}: {out[name]}")
    return out


def _gpu_name() -> str:
    kind = jax.devices()[0].device_kind.lower()
    names = {"h200": "h200", "h100": "h100-sxm", "a100": "a100-80g", "l40s": "l40s"}
    return next((v for k, v in names.items() if k in kind.replace(" ", "")), "h200")


def markdown(report: dict[str, Any]) -> str:
    e, k = report.get("engine", {}), report.get("kernel", {})
    lines = [f"# gpu_step: {report['device']} ({report['jax']})", "", f"elapsed {report['elapsed_s']:.0f} s; "
             f"plan `{json.dumps(report['plan'])}`", "", "## Kernel vs reference", ""]
    lines += [f"- max abs error, {dt}: {err:.3g}" for dt, err in k.get("errors", {}).items()]
    lines += ["", "| case | backend | ms per layer |", "| --- | --- | ---: |"]
    lines += [f"| {case} | {name} | {ms:.3f} |" for case, t in k.get("ms_per_layer", {}).items()
              for name, ms in t.items()]
    lines += ["", f"## Engine steps ({e.get('backend')}, weight-read floor {e.get('weight_floor_ms', 0):.3f} ms, "
              f"{e.get('hardware')})", "", "| step | ms | MBU | MFU |", "| --- | ---: | ---: | ---: |"]
    for name in ("decode_1", "decode_8", "prefill"):
        r = e.get(name, {})
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else ""
        lines.append(f"| {name} | {r.get('step_ms', float('nan')):.3f} | {r.get('mbu', float('nan')):.1%} | {mfu} |"
                     if "step_ms" in r else f"| {name} | {r} | | |")
    lines += ["", f"forward alone, one-request decode: {e.get('forward_decode_1')}", ""]
    if "pallas_error" in e:
        lines.append(f"the Pallas backend failed, the steps ran on the reference: {e['pallas_error']}")
    if report.get("failed"):
        lines.append(f"failed parts: {', '.join(report['failed'])}")
    return "\n".join(lines) + "\n"


def main() -> None:
    args, out, log, t0 = begin(__doc__.splitlines()[0], "out/gpu_step", 330.0)
    plan = SMOKE if args.cpu_smoke else Plan()
    device = jax.devices()[0]
    report: dict[str, Any] = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
                              "plan": asdict(plan)}
    report["kernel"] = guarded(lambda: kernel_part(plan, log), log)
    report["engine"] = guarded(lambda: engine_part(plan, log, args.budget_s, t0), log)
    parts = [("kernel", report["kernel"]), ("engine", report["engine"]), *report["engine"].items()]
    report["failed"] = [name for name, v in parts if isinstance(v, dict) and "error" in v]
    finish(out, "gpu_step", report, markdown, log, t0)


if __name__ == "__main__":
    main()
