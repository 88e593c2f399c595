"""What every part of the GPU check shares: its start (arguments, sizes, output), a JSON record written after
each measurement (so a part cut at its budget still reports what it finished), figures against the issues'
targets, and the engine helpers (one synthetic-1b configuration for every part, so XLA's persistent cache
serves a part the programs an earlier one compiled)."""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import operator
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from scripts.gpu_parts import trace_parse

GIB = 2**30
OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, "==": operator.eq}


@dataclass(frozen=True)
class Sizes:
    """The sizes of one run: the H200's, or the CPU smoke run's (`SMOKE`: same code, tiny shapes)."""

    model: str = "synthetic-1b"
    big_model: str = "synthetic-8b"
    dtype: str = "bfloat16"
    prompt_len: int = 1024
    new_tokens: int = 64
    reps: int = 3
    trace_steps: int = 20
    batches: tuple[int, ...] = (1, 8)
    step_budget: int = 2048  # tokens a step: the prefill step and the chunk of a long prompt
    long_prompt: int = 8191  # an 8k prompt (the model's 8192 positions hold it and its one drawn token)
    long_context: int = 8000  # fp8 KV against bf16 KV at 8k
    kv_bytes: int = 4 * GIB
    max_model_len: int = 8192
    spec_prompt: int = 512
    spec_tokens: int = 128
    quality_model: str = "bard"
    quality_dtype: str = "bfloat16"
    eval_chars: int = 0  # 0: bard's whole held-out text
    eval_max_len: int = 0  # 0: the CLI's default window
    eval_batched_tokens: int = 1024  # bard's engines: a step holds a 511-token window
    eval_jobs: int = 4  # `jaxserve eval perplexity` processes at once (one a time on a 2-core CPU)
    quality_modes: int = 4  # bf16 and the three quantized modes (the smoke run: bf16 and fp8 weights)
    report_modes: int = 2  # bf16 and fp8 (the smoke run: bf16)
    greedy_prompts: int = 8
    greedy_tokens: int = 32


SMOKE = Sizes(model="tiny", big_model="tiny", dtype="float32", prompt_len=40, new_tokens=6, reps=1, trace_steps=3,
              batches=(1, 4), step_budget=64, long_prompt=255, long_context=120, kv_bytes=8 * 2**20,
              max_model_len=256, spec_prompt=48, spec_tokens=12, quality_dtype="float32", eval_chars=600,
              eval_max_len=48, eval_batched_tokens=64, eval_jobs=1, quality_modes=2, report_modes=1,
              greedy_prompts=2, greedy_tokens=6)


def engine_args(sizes: Sizes, model: str | None = None, **overrides: Any) -> dict[str, Any]:
    """The one engine configuration of the check, as `LLM(**...)` / `EngineConfig(**...)` arguments (overrides:
    the loop, quantization, KV dtype, speculation)."""
    b = sizes.step_budget
    fields = dict(model=model or sizes.model, dtype=sizes.dtype, max_num_seqs=8, max_num_batched_tokens=b,
                  chunk_size=b, token_buckets=(1, 8, b), seq_buckets=(1, 8), kv_cache_memory=sizes.kv_bytes,
                  max_model_len=sizes.max_model_len, enable_prefix_caching=False)
    return {**fields, **overrides}


def engine_config(sizes: Sizes, model: str | None = None, **overrides: Any) -> EngineConfig:
    return EngineConfig(**engine_args(sizes, model, **overrides))


def build_llm(part: Part, key: str, **args: Any):
    """`LLM(**args)`, its build time, loop and policy recorded under results[key]; None if it failed."""
    from jaxserve.engine.llm import LLM

    holder: dict[str, Any] = {}

    def build() -> dict[str, Any]:
        t = time.perf_counter()
        holder["llm"] = llm = LLM(**args)
        engine = llm.engine
        return {"build_s": time.perf_counter() - t, "loop": engine.loop.name, "policy": engine.policy.describe(),
                "attention_backend": engine.config.attention_backend, "token_buckets": engine.runner.token_buckets}

    part.run(key, build)
    return holder.get("llm")


def prompts(batch: int, length: int, salt: int = 0) -> list[list[int]]:
    """`batch` distinct token-id prompts of `length` (ids 1-250: bytes of the synthetic presets' tokenizer)."""
    return [[(7 * i + 13 * salt + j) % 250 + 1 for j in range(length)] for i in range(batch)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def tpot_ms(llm, batch: int, sizes: Sizes) -> dict[str, Any]:
    """TPOT end to end through `LLM.generate`: `batch` prompts of `prompt_len`, `new_tokens` greedy tokens; the
    median over `reps` runs (after one warm run) of the requests' median TPOT."""
    ps, params = prompts(batch, sizes.prompt_len), greedy(sizes.new_tokens)
    llm.generate(ps, params)
    runs = []
    for _ in range(sizes.reps):
        outs = llm.generate(ps, params)
        runs.append(1e3 * float(np.median([o.metrics.tpot for o in outs])))
    return {"tpot_ms": float(np.median(runs)), "runs_ms": runs}


def to_decoding(engine, batch: int, sizes: Sizes, context: int, tag: str) -> list[str]:
    """Add `batch` requests of `context`-token prompts and step until each has drawn a token, then 3 steps more
    (loop-agnostic: the overlapped loop reports a step's tokens one call later)."""
    ids = [f"{tag}{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts(batch, context, salt=len(tag)), strict=True):
        engine.add_request(rid, p, greedy(sizes.max_model_len - context - 1))
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids}
    for _ in range(3):
        engine.step()
    return ids


def drain(engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def step_ms(engine, batch: int, sizes: Sizes, context: int, steps: int | None = None) -> dict[str, Any]:
    """Median engine step (the engine's loop) of `batch` requests decoding at ~`context` tokens."""
    ids = to_decoding(engine, batch, sizes, context, f"s{batch}-")
    times = []
    for _ in range(steps or 2 * sizes.trace_steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    drain(engine, ids)
    return {"step_ms": 1e3 * float(np.median(times)), "mean_ms": 1e3 * float(np.mean(times))}


def trace_steps(engine, batch: int, sizes: Sizes, out: Path, label: str, context: int | None = None,
                steps: int | None = None) -> dict[str, Any]:
    """`jax.profiler.trace` of `steps` engine steps of `batch` requests decoding at ~`context` tokens: the trace
    kept as OUT/traces/LABEL.json.gz, and its summary (`trace_parse.summarize`)."""
    steps = steps or sizes.trace_steps
    ids = to_decoding(engine, batch, sizes, context or sizes.prompt_len, f"t{batch}-")
    summary = trace_run(lambda: [engine.step() for _ in range(steps)], steps, out, label)
    drain(engine, ids)
    return summary


def trace_run(fn: Callable[[], Any], steps: int, out: Path, label: str) -> dict[str, Any]:
    """Trace `fn()` (which runs `steps` steps), keep the trace, return its summary."""
    folder = tempfile.mkdtemp(prefix="jaxserve-trace-")
    try:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            fn()
        (found,) = glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)
        (out / "traces").mkdir(exist_ok=True)
        kept = out / "traces" / f"{label}.json.gz"
        shutil.copy(found, kept)
        return {**trace_parse.summarize_file(kept, steps), "trace": str(kept.relative_to(out))}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def hardware_name() -> str:
    """The planner's hardware profile for this device (cpu on a CPU)."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind.lower().replace(" ", "")
    names = {"h200": "h200", "h100": "h100-sxm", "a100": "a100-80g", "l40s": "l40s"}
    return next((v for k, v in names.items() if k in kind), "h200")


class Part:
    """One part's run: `python3 -m scripts.gpu_parts.NAME OUT [--smoke] [--budget-s S]`. Writes OUT/NAME.json
    after every measurement: {"results": ..., "figures": [...], "errors": {...}, "skipped": [...]}."""

    def __init__(self, name: str, description: str, budget_s: float):
        ap = argparse.ArgumentParser(description=description)
        ap.add_argument("out")
        ap.add_argument("--smoke", action="store_true", help="tiny sizes on a CPU (the same code path)")
        ap.add_argument("--budget-s", type=float, default=budget_s, help="start nothing after this")
        args = ap.parse_args()
        self.name, self.out, self.smoke, self.budget = name, Path(args.out), args.smoke, args.budget_s
        self.out.mkdir(parents=True, exist_ok=True)
        self.sizes = SMOKE if args.smoke else Sizes()
        self.t0 = time.perf_counter()
        device = jax.devices()[0]
        self.record: dict[str, Any] = {"part": name, "device": device.device_kind, "platform": device.platform,
                                       "jax": jax.__version__, "smoke": self.smoke, "sizes": dataclasses.asdict(
                                           self.sizes), "results": {}, "figures": [], "errors": {}, "skipped": []}
        self.write()

    def log(self, msg: str) -> None:
        print(f"[{self.name} {time.perf_counter() - self.t0:6.1f} s] {msg}", flush=True)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def write(self) -> None:
        self.record["elapsed_s"] = time.perf_counter() - self.t0
        tmp = self.out / f".{self.name}.json.tmp"
        tmp.write_text(json.dumps(self.record, indent=2, default=str) + "\n")
        tmp.replace(self.out / f"{self.name}.json")

    def run(self, key: str, fn: Callable[[], Any], need_s: float = 0.0) -> Any:
        """fn()'s result kept under results[key]; None when fewer than `need_s` seconds of the budget are left
        (recorded as skipped) or when it raised (the error recorded; the part goes on)."""
        if self.left() < need_s:
            self.record["skipped"].append(f"{key}: {self.left():.0f} s left of the budget, needs ~{need_s:.0f}")
            self.log(f"{key}: skipped ({self.left():.0f} s left)")
            self.write()
            return None
        t = time.perf_counter()
        try:
            value = fn()
        except Exception as e:
            self.log(traceback.format_exc())
            self.record["errors"][key] = f"{type(e).__name__}: {e}"[:600]
            self.write()
            return None
        self.record["results"][key] = value
        self.log(f"{key} ({time.perf_counter() - t:.1f} s): {_short(value)}")
        self.write()
        return value

    def figure(self, name: str, value: float | None, unit: str, op: str | None, target: float | None,
               issue: str) -> None:
        """A measured figure beside its target (`value op target`, e.g. TPOT <= 0.9 ms; op None: reported only),
        for the summary."""
        met = None if op is None or value is None or not np.isfinite(value) else bool(OPS[op](value, target))
        self.record["figures"].append({"name": name, "value": value, "unit": unit,
                                       "target": "reported" if op is None else f"{op} {target:g}", "met": met,
                                       "issue": issue})
        self.write()

    def finish(self) -> None:
        self.write()
        self.log(f"done in {time.perf_counter() - self.t0:.1f} s; wrote {self.out / self.name}.json")


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) < 300 else text[:300] + "..."


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    """a[key] / b[key], None when either is missing."""
    if not a or not b or not b.get(key) or a.get(key) is None:
        return None
    return a[key] / b[key]
