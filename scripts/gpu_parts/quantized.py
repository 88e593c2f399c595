"""Part `quantized` (issue 42 item 1): fp8 and int8 weights and an fp8 KV cache against bf16 on synthetic-1b.

For each variant (bf16; `--quantization fp8`; `--quantization int8`; `--kv-cache-dtype fp8`) an engine with the
platform's default loop: the median engine step of 1 and of 8 requests decoding at ~1k context, and the device's
busy time a step from a short trace (what the kernels take, whatever the host does); bf16 and fp8 KV also one
request at ~8k context. Targets (issue 42), each as a ratio to bf16: fp8 weights <= 0.6x at one request, int8
<= 0.65x, both <= 0.75x at eight; fp8 KV no slower than bf16 KV at 1k (<= 1.0x) and faster at 8k (< 1.0x).
"""

from __future__ import annotations

import gc
import time

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from scripts.gpu_parts.common import Part, engine_args, ratio, step_ms, trace_steps

# (label, --quantization, --kv-cache-dtype); bf16 first: the others are compared with it.
VARIANTS = (("bf16", None, "auto"), ("fp8 weights", "fp8", "auto"), ("int8 weights", "int8", "auto"),
            ("fp8 KV", None, "fp8"))
WEIGHT_TARGETS = {("fp8 weights", 1): 0.6, ("int8 weights", 1): 0.65, ("fp8 weights", 8): 0.75,
                  ("int8 weights", 8): 0.75}


def measure(part: Part, label: str, engine: LLMEngine, batch: int, context: int) -> dict:
    s = part.sizes
    r = step_ms(engine, batch, s, context, steps=s.trace_steps)
    tag = label.replace(" ", "_")
    t = trace_steps(engine, batch, s, part.out, f"quantized_{tag}_b{batch}_c{context}", context,
                    steps=max(2, s.trace_steps // 2))
    return {**r, "busy_us": t["busy_us"], "traced_step_us": t["step_us"],
            "top_kernels": t["top_kernels"][:5], "trace": t["trace"]}


def variant(part: Part, label: str, quantization: str | None, kv: str, contexts: tuple[int, ...]) -> dict:
    """Build the variant's engine and measure it at each context: {(label, batch, context): measurement}."""
    s, holder, got = part.sizes, {}, {}

    def build():
        t = time.perf_counter()
        holder["engine"] = e = LLMEngine(EngineConfig(**engine_args(s, quantization=quantization,
                                                                    kv_cache_dtype=kv)))
        return {"build_s": time.perf_counter() - t, "loop": e.loop.name, "policy": e.policy.describe()}

    if part.run(f"{label} engine", build, need_s=15) is None:
        return got
    for context in contexts:
        for b in (s.batches if context == s.prompt_len else (1,)):
            r = part.run(f"{label} b{b} c{context}", lambda b=b, c=context: measure(
                part, label, holder["engine"], b, c), need_s=5)
            if r is not None:
                got[label, b, context] = r
    return got


def main() -> None:
    part = Part("quantized", __doc__.splitlines()[0], 100)
    s = part.sizes
    contexts = {"bf16": (s.prompt_len, s.long_context), "fp8 KV": (s.prompt_len, s.long_context)}
    got: dict[tuple[str, int, int], dict] = {}
    for label, quantization, kv in VARIANTS:
        got.update(variant(part, label, quantization, kv, contexts.get(label, (s.prompt_len,))))
        gc.collect()  # this variant's engine and KV pool go before the next is built
    for (label, b), target in WEIGHT_TARGETS.items():
        b = max(s.batches) if b == 8 else b
        for key, what in (("step_ms", "engine step"), ("busy_us", "device busy")):
            value = ratio(got.get((label, b, s.prompt_len)), got.get(("bf16", b, s.prompt_len)), key)
            part.figure(f"{label} / bf16, {what}, {b} request(s)", value, "x", "<=", target, "42")
    for context, op, target in ((s.prompt_len, "<=", 1.0), (s.long_context, "<", 1.0)):
        for key, what in (("step_ms", "engine step"), ("busy_us", "device busy")):
            value = ratio(got.get(("fp8 KV", 1, context)), got.get(("bf16", 1, context)), key)
            part.figure(f"fp8 KV / bf16 KV, {what}, 1 request at ~{context} context", value, "x", op, target, "42")
    part.finish()


if __name__ == "__main__":
    main()
