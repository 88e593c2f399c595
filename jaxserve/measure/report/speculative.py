"""The report's speculative row: one request's TPOT with and without speculation, against the planner.

The same prompt runs on the report's engine (no speculation) and on a second engine with `--speculative-config`,
alternating, `spec_repeats` times each. The planner is given what the run measured about the proposer: the verify
steps that carried drafts, the drafts they verified (fewer than k where n-gram lookup found fewer or the request's
end was near) and the tokens they emitted, the other decode steps; it prices each kind of step
(`planner.speculative`: the verify step with 1 + drafts rows, the proposer's k draft steps inside the round's one
dispatch, a plain decode step) and predicts TPOT = their time over the tokens. Target: within 15% of the measured
TPOT. Beside it, the round itself: the median wall time of the steps that verified drafts against the verify step
and the proposer priced together (where an error comes from: the round's price or the counts).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.measure.report.context import Context, error_pct, fmt, fmt_pct
from jaxserve.model.dtypes import planner_dtype
from modelspec.spec import load_model_spec
from planner.speculative import proposer_s, verify_step_s
from planner.step_model import decode_shape, pad_tokens, step_time_shape

TPOT_TARGET_PCT = 15.0


def _one_request(engine: LLMEngine, prompt: list[int], output_len: int, rid: str) -> dict[str, Any]:
    """One greedy request's TPOT and speculation counts, and the wall time of each decode step, apart for the
    steps that verified drafts (a round) and the others (the first step, its prompt, is in neither)."""
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    req = engine.scheduler.get_request(rid)
    out, rounds, others, first = None, [], [], True
    while engine.has_unfinished_requests():
        verified = req.spec_num_steps
        t0 = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t0
        if not first:
            (rounds if req.spec_num_steps > verified else others).append(dt)
        first = False
        for o in outputs:
            out = o if o.finished else out
    m = out.metrics
    return {"tpot_s": m.tpot, "tokens": len(out.token_ids), "verify_steps": m.spec_num_steps,
            "draft_tokens": m.spec_num_draft_tokens, "accepted": m.spec_num_accepted_tokens,
            "round_s": rounds, "other_s": others}


def run_speculative(ctx: Context) -> list[dict[str, Any]]:
    """Measure and predict one request's TPOT with `ctx.cfg.speculative` against the plain engine."""
    cfg, base = ctx.cfg, ctx.engine
    spec_engine = LLMEngine(dataclasses.replace(base.config, speculative_config=cfg.speculative))
    sc = spec_engine.config.speculative_config
    k = sc.num_speculative_tokens
    prompt = _prompt(ctx, cfg.spec_prompt_len)
    plain, spec = [], []
    for i in range(cfg.spec_repeats + 1):  # the first round of each warms its caches and is dropped
        for engine, runs in ((base, plain), (spec_engine, spec)):
            engine.kv_manager.reset_prefix_cache()
            r = _one_request(engine, prompt, cfg.spec_output_len, f"{ctx.next_salt()}-spec{i}")
            if i:
                runs.append(r)
    m_plain = statistics.median(r["tpot_s"] for r in plain)
    m_spec = statistics.median(r["tpot_s"] for r in spec)
    verify_steps = sum(r["verify_steps"] for r in spec) / len(spec)
    accepted = sum(r["accepted"] for r in spec) / len(spec)
    decode_tokens = cfg.spec_output_len - 1  # tokens after the first
    other_steps = max(0.0, decode_tokens - accepted - verify_steps)  # decode steps that carried no draft
    context = cfg.spec_prompt_len + cfg.spec_output_len / 2
    buckets = base.runner.token_buckets
    kw = dict(**ctx.dtypes, token_buckets=buckets)
    draft = load_model_spec(sc.model) if sc.method == "draft_model" else None
    verify = _verify_at(ctx, context, sum(r["draft_tokens"] for r in spec) / max(1.0, verify_steps * len(spec)),
                        **kw)
    # The draft model loads in the float dtype (--quantization is the target's): price its weights so.
    proposer = proposer_s(sc.method, ctx.hw, 1, context, k, draft=draft, **{**kw, "dtype": planner_dtype(base.dtype)})
    decode = step_time_shape(ctx.spec, ctx.hw, decode_shape(1, context), **ctx.dtypes,
                             padded_tokens=pad_tokens(1, buckets)).total_s
    predicted = (verify_steps * (verify + proposer) + other_steps * decode) / decode_tokens
    drafts = sum(r["draft_tokens"] for r in spec)
    row = {"kind": "speculative", "config": {"method": sc.method, "k": k, "draft_model": sc.model,
                                             "prompt_len": cfg.spec_prompt_len, "output_len": cfg.spec_output_len,
                                             "repeats": cfg.spec_repeats},
           "measured_tpot_ms": m_spec * 1e3, "predicted_tpot_ms": predicted * 1e3,
           "tpot_error_pct": error_pct(predicted * 1e3, m_spec * 1e3),
           "measured_plain_tpot_ms": m_plain * 1e3, "predicted_plain_tpot_ms": decode * 1e3,
           "measured_speedup": m_plain / m_spec, "acceptance_rate": sum(r["accepted"] for r in spec) / drafts
           if drafts else None, "tokens_per_verify_step": 1 + accepted / verify_steps if verify_steps else None,
           "verify_steps": verify_steps, "plain_steps": other_steps,
           "drafts_per_verify_step": drafts / (verify_steps * len(spec)) if verify_steps else None,
           "predicted_verify_step_ms": verify * 1e3, "predicted_proposer_ms": proposer * 1e3,
           "predicted_round_ms": (verify + proposer) * 1e3, "measured_round_ms": _median_ms(spec, "round_s"),
           "measured_plain_step_ms": _median_ms(plain, "other_s")}
    row["met"] = row["tpot_error_pct"] is not None and abs(row["tpot_error_pct"]) <= TPOT_TARGET_PCT
    ctx.log(f"speculative ({sc.method}, k={k}): TPOT {m_spec * 1e3:.2f} ms (predicted {predicted * 1e3:.2f}) "
            f"against {m_plain * 1e3:.2f} ms without; acceptance {fmt(row['acceptance_rate'], '.2f')}")
    return [row]


def _median_ms(runs: list[dict[str, Any]], key: str) -> float | None:
    """The median over every run's steps of one kind (ms); None when no run had one."""
    steps = [t for r in runs for t in r[key]]
    return statistics.median(steps) * 1e3 if steps else None


def _verify_at(ctx: Context, context: float, drafts: float, **kw) -> float:
    """A verify step of `drafts` drafts on average: the steps of the two whole counts around it, interpolated."""
    lo = max(1, int(drafts))
    t_lo = verify_step_s(ctx.spec, ctx.hw, 1, context, lo, **kw)
    if drafts <= lo:
        return t_lo
    return t_lo + (drafts - lo) * (verify_step_s(ctx.spec, ctx.hw, 1, context, lo + 1, **kw) - t_lo)


def _prompt(ctx: Context, n: int) -> list[int]:
    """A prompt that repeats a phrase (what n-gram lookup copies from), free of EOS."""
    eos = ctx.spec.eos_token_id
    phrase = [t for t in range(7, 7 + 24) if t != eos]
    return (phrase * (n // len(phrase) + 1))[:n]


def markdown(report: dict[str, Any]) -> list[str]:
    """The speculative row's table (none when the report ran without `--speculative-config`)."""
    rows = [r for r in report["rows"] if r["kind"] == "speculative"]
    if not rows:
        return []
    lines = ["## Speculative decoding (one request)", "",
             "| method | k | acceptance | tokens / verify step | round pred | round meas | TPOT pred | TPOT meas | "
             "err | TPOT without | speed-up | within 15% |", "|" + "---|" * 12]
    for r in rows:
        c = r["config"]
        lines.append(f"| {c['method']} {c['draft_model'] or ''} | {c['k']} | {fmt(r['acceptance_rate'], '.2f')} | "
                     f"{fmt(r['tokens_per_verify_step'], '.2f')} | {fmt(r.get('predicted_round_ms'), '.2f')} | "
                     f"{fmt(r.get('measured_round_ms'), '.2f')} | {fmt(r['predicted_tpot_ms'], '.2f')} | "
                     f"{fmt(r['measured_tpot_ms'], '.2f')} | {fmt_pct(r['tpot_error_pct'])} | "
                     f"{fmt(r['measured_plain_tpot_ms'], '.2f')} | {fmt(r['measured_speedup'], '.2f')}x | "
                     f"{r['met']} |")
    return lines + [""]
