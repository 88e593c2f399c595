"""Reference steps between the report's parts: did the machine run as fast as when it was calibrated?

A report calibrates once, then measures for minutes. On a shared machine (a cloud VM, a laptop with other
work) the speed can change in between, and a point's error then says more about the machine than about the
planner. So before the first part and after each one the report times two fixed steps, a lone prefill
(compute-bound) and a few decodes (bound by reading the weights), beside the planner's prediction of each:
a measured / predicted ratio that moves between checkpoints is the machine drifting, not the model.
"""

from __future__ import annotations

from typing import Any

from jaxserve.measure.calibrate.steps import PromptSource, measure_decode, measure_prefill
from planner.step_model import pad_tokens, step_time_shape

PREFILL_TOKENS = 256
DECODES, DECODE_CONTEXT, DECODE_STEPS = 4, 128, 16
# Past this spread of a reference step's measured / predicted ratio the report says the machine was unsteady:
# above what quiet checkpoints spread, below what a slow spell moves them; see docs/tuning.md.
UNSTEADY_DRIFT = 1.15


def probe(ctx: Any, when: str) -> dict[str, Any]:
    """Time the reference steps now (the engine must be idle); their predictions and ratios, labelled `when`."""
    engine = ctx.engine
    ctx.next_salt()  # fresh prompts each time: a repeated one would be served from the prefix cache
    ids = PromptSource(engine, 7919 * ctx.cfg.seed + ctx.salt)
    sc = engine.scheduler.config  # a longer prompt would be chunked, and measure_prefill keeps one-step prefills
    prefill_len = min(PREFILL_TOKENS, sc.max_num_batched_tokens, sc.chunk_size, engine.max_model_len - 1)
    samples = measure_prefill(engine, ids, (prefill_len,), repeats=3)
    context = min(DECODE_CONTEXT, engine.max_model_len - DECODE_STEPS - 8)
    samples += measure_decode(engine, ids, min(DECODES, engine.config.max_num_seqs), context, DECODE_STEPS)
    out: dict[str, Any] = {"when": when}
    for s in samples:
        predicted = step_time_shape(ctx.spec, ctx.hw, s.shape, **ctx.dtypes,
                                    padded_tokens=pad_tokens(s.shape.num_tokens, engine.runner.token_buckets)).total_s
        out[s.kind] = {"tokens": s.shape.num_tokens, "measured_ms": s.seconds * 1e3,
                       "predicted_ms": predicted * 1e3, "measured_over_predicted": s.seconds / predicted}
    ctx.log("reference steps " + when + ": " + ", ".join(
        f"{k} {v['measured_ms']:.1f} ms ({v['measured_over_predicted']:.2f}x predicted)"
        for k, v in out.items() if k != "when"))
    return out


def drift(probes: list[dict[str, Any]]) -> dict[str, float] | None:
    """Per step kind, the largest over the smallest measured / predicted ratio across the checkpoints."""
    out = {}
    for kind in ("prefill", "decode"):
        ratios = [p[kind]["measured_over_predicted"] for p in probes if kind in p]
        if len(ratios) >= 2:
            out[kind] = max(ratios) / min(ratios)
    return out or None


def drift_note(drift_by_kind: dict[str, float] | None) -> str | None:
    """A warning sentence when a reference step's ratio spread past UNSTEADY_DRIFT, else None."""
    over = {k: v for k, v in (drift_by_kind or {}).items() if v > UNSTEADY_DRIFT}
    if not over:
        return None
    what = ", ".join(f"{k} {v:.2f}x" for k, v in over.items())
    return (f"The machine was unsteady during this run (reference steps moved {what} against their predictions, "
            f"more than {UNSTEADY_DRIFT:.2f}x): its errors mix the planner's with the machine's; rerun on a quiet "
            "machine before judging the planner.")


def probe_markdown(report: dict[str, Any]) -> list[str]:
    """The checkpoints as a table (empty when the report has none)."""
    probes = report.get("reference_steps") or []
    if not probes:
        return []
    lines = ["## Reference steps (the machine's speed between parts)", "",
             "| checkpoint | prefill meas / pred ms | ratio | decode meas / pred ms | ratio |", "|---|---|---|---|---|"]
    for p in probes:
        cells = []
        for kind in ("prefill", "decode"):
            v = p.get(kind)
            cells += ([f"{v['measured_ms']:.1f} / {v['predicted_ms']:.1f}", f"{v['measured_over_predicted']:.2f}"]
                      if v else ["-", "-"])
        lines.append(f"| {p['when']} | " + " | ".join(cells) + " |")
    prefill = next((p["prefill"]["tokens"] for p in probes if "prefill" in p), PREFILL_TOKENS)
    lines += ["", f"A lone {prefill}-token prefill (the minimum of 3) and a step of {DECODES} decodes at "
              f"~{DECODE_CONTEXT} tokens of context (the median of {DECODE_STEPS}), timed before the first part and "
              "after each: a ratio that moves between rows is the machine, not the planner.", ""]
    return lines
