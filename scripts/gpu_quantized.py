"""One prepared GPU run of quantized weights and KV (issue 27): int8 and fp8 weights and an fp8 KV cache against bf16.

    scripts/gpu_quantized.sh [OUT_DIR]             # on one H200, from a bare checkout: about 4 minutes
    PYTHONPATH=. python3 scripts/gpu_quantized.py --cpu-smoke [OUT_DIR]   # the same run end to end on a CPU, tiny

Needs what scripts/gpu_step.py needs (jax with CUDA, flax, numpy, click). For each variant of `synthetic-1b` in
bfloat16 (plain; `--quantization int8`; `--quantization fp8`; `--kv-cache-dtype fp8`) it builds an `LLMEngine`
(attention backend `auto`), times the median engine step of 1 and of 8 requests decoding at ~1k tokens of context,
and prints each beside the plain engine's (the ratio), its MBU (the bytes the planner counts for that variant's
dtypes over time over HBM bandwidth), the parameter bytes the engine holds and the first greedy tokens against the
plain engine's. Each variant is timed and recorded even when another fails. Writes gpu_quantized.json and
gpu_quantized.md into OUT_DIR (default: $OUT if set, else out/gpu_quantized).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_step import _gpu_name, begin, finish, guarded, to_decoding  # noqa: E402

from jaxserve.config.engine import EngineConfig  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.measure.eval.agreement import agreement_counts  # noqa: E402
from jaxserve.model.dtypes import planner_dtype  # noqa: E402
from jaxserve.runner.model_runner import bucket_for  # noqa: E402
from modelspec.spec import PRESETS  # noqa: E402
from planner.hardware import load_hardware  # noqa: E402
from planner.step_model import decode_shape, op_costs  # noqa: E402

# (label, --quantization, --kv-cache-dtype); the first is the reference the others are compared with.
VARIANTS = (("plain", None, "auto"), ("int8 weights", "int8", "auto"), ("fp8 weights", "fp8", "auto"),
            ("fp8 KV", None, "fp8"))


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the GPU's, or the CPU smoke test's."""

    model: str = "synthetic-1b"
    dtype: str = "bfloat16"
    page_size: int = 16
    decode_context: int = 1024
    batches: tuple[int, ...] = (1, 8)
    steps: int = 50
    greedy_tokens: int = 32
    kv_bytes: int = 2 * 2**30
    max_model_len: int = 4096


SMOKE = Plan(model="tiny", dtype="float32", decode_context=48, batches=(1, 2), steps=3, greedy_tokens=8,
             kv_bytes=8 * 2**20, max_model_len=256)


def engine_for(plan: Plan, quantization: str | None, kv_cache_dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=plan.model, dtype=plan.dtype, quantization=quantization,
                                  kv_cache_dtype=kv_cache_dtype, max_num_seqs=8, max_num_batched_tokens=2048,
                                  chunk_size=2048, page_size=plan.page_size, kv_cache_memory=plan.kv_bytes,
                                  max_model_len=plan.max_model_len, enable_prefix_caching=False,
                                  token_buckets=(1, 8, 2048), seq_buckets=(1, 8)))


def decode_step(engine: LLMEngine, plan: Plan, batch: int, hw, dtypes: tuple[str, str]) -> dict[str, Any]:
    """Median engine step of `batch` requests decoding at ~decode_context tokens, and its MBU at `dtypes`."""
    params = SamplingParams(temperature=0, max_tokens=plan.steps + 16, ignore_eos=True)
    prompts = [[(7 * i + j) % 200 + 1 for j in range(plan.decode_context)] for i in range(batch)]
    ids = to_decoding(engine, prompts, params, f"q{batch}-")
    times, contexts = [], []
    for _ in range(plan.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        contexts.append(engine.last_step.decode_context_tokens / max(1, engine.last_step.num_decode_tokens))
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    step = float(np.median(times))
    ops = op_costs(PRESETS[plan.model], decode_shape(batch, float(np.mean(contexts)) - 1), dtype=dtypes[0],
                   kv_dtype=dtypes[1], padded_tokens=bucket_for(batch, engine.runner.token_buckets))
    nbytes = sum(o.count * (o.weight_bytes + o.kv_bytes + o.act_bytes) for o in ops)
    return {"step_ms": 1e3 * step, "bytes": nbytes, "mbu": nbytes / step / hw.memory_bw}


def greedy(engine: LLMEngine, plan: Plan) -> list[int]:
    """The greedy tokens of one fixed prompt."""
    params = SamplingParams(temperature=0, max_tokens=plan.greedy_tokens, ignore_eos=True)
    engine.add_request("greedy", [(5 * j) % 250 + 1 for j in range(64)], params)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    return list(out.token_ids)


def parameter_bytes(engine: LLMEngine) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(engine.runner.params))


def variant(plan: Plan, quantization: str | None, kv: str, hw, log) -> dict[str, Any]:
    t = time.perf_counter()
    engine = engine_for(plan, quantization, kv)
    dtypes = (quantization or planner_dtype(engine.dtype), planner_dtype(engine.dtype) if kv == "auto" else kv)
    out: dict[str, Any] = {"build_and_warmup_s": time.perf_counter() - t, "attention_backend":
                           engine.config.attention_backend, "parameter_bytes": parameter_bytes(engine),
                           "planner_dtypes": dtypes, "greedy": greedy(engine, plan)}
    for b in plan.batches:
        out[f"decode_{b}"] = decode_step(engine, plan, b, hw, dtypes)
        log(f"  decode {b}: {out[f'decode_{b}']}")
    return out


def markdown(report: dict[str, Any]) -> str:
    plan, rows = report["plan"], report["variants"]
    base = rows.get(VARIANTS[0][0], {})
    lines = [f"# gpu_quantized: {report['device']} ({report['jax']})", "",
             f"{plan['model']} in {plan['dtype']}, decode at ~{plan['decode_context']} tokens of context; elapsed "
             f"{report['elapsed_s']:.0f} s", "", "| variant | backend | parameters (MiB) | " +
             " | ".join(f"{b} req. step ms (x plain) | MBU" for b in plan["batches"]) + " | greedy agreement |",
             "|---|---|---:|" + "---:|---:|" * len(plan["batches"]) + "---:|"]
    for label, r in rows.items():
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error']} |")
            continue
        cells = []
        for b in plan["batches"]:
            d, d0 = r[f"decode_{b}"], base.get(f"decode_{b}", {})
            ratio = d["step_ms"] / d0["step_ms"] if d0.get("step_ms") else float("nan")
            cells += [f"{d['step_ms']:.3f} ({ratio:.2f}x)", f"{d['mbu']:.1%}"]
        before, _, total = agreement_counts([r["greedy"]], [base["greedy"]]) if base.get("greedy") else (0, 0, 0)
        agree = before / total if total else float("nan")
        lines.append(f"| {label} | {r['attention_backend']} | {r['parameter_bytes'] / 2**20:.1f} | "
                     + " | ".join(cells) + f" | {agree:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args, out, log, t0 = begin(__doc__.splitlines()[0], "out/gpu_quantized", 300.0)
    plan = SMOKE if args.cpu_smoke else Plan()
    device = jax.devices()[0]
    hw = load_hardware("cpu" if device.platform == "cpu" else _gpu_name())
    report: dict[str, Any] = {"device": device.device_kind, "jax": jax.__version__, "plan": asdict(plan),
                              "hardware": hw.name, "variants": {}}
    for label, quantization, kv in VARIANTS:
        if time.perf_counter() - t0 > args.budget_s:
            report["variants"][label] = {"error": f"skipped: past the {args.budget_s:.0f} s budget"}
            continue
        log(f"{label}: building")
        report["variants"][label] = guarded(lambda q=quantization, k=kv: variant(plan, q, k, hw, log), log)
    finish(out, "gpu_quantized", report, markdown, log, t0)


if __name__ == "__main__":
    main()
