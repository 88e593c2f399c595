"""Prefix caching on and off, on the two workloads of issue 4, with the planner's prediction beside them.

Workloads (jaxserve.measure.bench.datasets): multi-turn chat (each turn's prompt is the whole conversation so far plus
a new message; conversations run side by side, each turn waiting for the previous one) and a shared system
prompt (groups of requests sharing a long prefix, short questions, Poisson arrivals). One engine per setting
(caching on / off), the same requests for both. Prints mean and p90 TTFT, the mean TTFT of turns whose
history passed 1k tokens, the hit rate, and the planner's mean TTFT (closed form and simulated) for the
measured hit rate on a calibrated profile (--profile, e.g. from `jaxserve calibrate --model small --out profile.json`).

    python scripts/bench_prefix_cache.py --model small --profile reports/small/profile.json \
        --out reports/prefix_cache.json

Both engines live side by side and the runs alternate, on then off, `--repeats` times (fresh cache salts each
time, so a repeat never hits an earlier one's pages): the two settings see the same machine, whose speed drifts
by 10-25% within minutes, and the pooled means average that drift out. Each repeat's ratio is printed too.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np


def summarize(runs: list, long_history: int) -> dict:
    """Pooled over the repeats' runs of one workload and setting."""
    records = [r for run in runs for r in run.records]
    ok = [r for r in records if r.success]
    ttfts = np.array([r.ttft for r in ok]) * 1e3
    long = [r.ttft * 1e3 for r in ok if r.prompt_len > long_history]
    prompt = sum(r.prompt_len for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    return {"completed": len(ok), "failed": len(records) - len(ok), "mean_ttft_ms": float(ttfts.mean()),
            "p90_ttft_ms": float(np.percentile(ttfts, 90)),
            "mean_ttft_long_history_ms": float(np.mean(long)) if long else None, "long_history_requests": len(long),
            "hit_rate": cached / max(1, prompt), "mean_input_len": prompt / max(1, len(ok)),
            "duration_s": sum(run.duration for run in runs), "repeats": len(runs)}


def predict_ttft(model: str, profile: str, s: dict, concurrency: float | None, rate: float | None,
                 output_len: int, engine, arrivals: list[float] | None = None) -> dict[str, float]:
    """The planner's mean TTFT for the measured hit rate: closed form, and its discrete-event simulator.

    The simulator replays the run's own arrivals (open loop) or runs `concurrency` closed-loop clients; with
    equal turn lengths those clients move in lockstep, as the benchmark's conversations do, and their turns
    queue behind each other, which the closed form's steady state does not see.
    """
    import planner
    from modelspec.memory import MemoryPlan, kv_bytes_per_token
    from planner.api import load_hardware, resolve_model
    from planner.simulate import simulate

    cfg = engine.config
    per_tok = kv_bytes_per_token(engine.spec, "fp32")
    mem = MemoryPlan(weights=0.0, kv=engine.num_pages * cfg.page_size * per_tok, activations=0.0, total=0.0,
                     kv_bytes_per_token=per_tok, num_pages=engine.num_pages - 1, page_size=cfg.page_size)
    workload = planner.Workload(input_len=round(s["mean_input_len"]), output_len=output_len,
                                prefix_hit=min(0.99, s["hit_rate"]), concurrency=concurrency, request_rate=rate)
    config = planner.ServingConfig(max_num_seqs=cfg.max_num_seqs, chunk_size=cfg.max_num_batched_tokens,
                                   page_size=cfg.page_size, dtype="fp32",
                                   token_buckets=tuple(engine.runner.token_buckets))
    closed = planner.predict_serving(model, profile, workload, config, memory=mem).ttft.mean
    sim = simulate(resolve_model(model), load_hardware(profile), workload, config, num_requests=s["completed"],
                   warmup_fraction=0.0, arrival_times=None if concurrency else arrivals)
    return {"predicted_mean_ttft_ms": closed, "simulated_mean_ttft_ms": sim.ttft.mean}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--profile", default=None, help="calibrated hardware profile for the planner's prediction")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--message-len", type=int, default=256)
    ap.add_argument("--answer-len", type=int, default=32)
    ap.add_argument("--shared-prompts", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=1536)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--shared-rate", type=float, default=0.5)
    ap.add_argument("--workloads", default="multi-turn,shared-prefix")
    ap.add_argument("--repeats", type=int, default=3, help="alternating on/off runs, pooled")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.measure.bench.datasets import DatasetConfig, generate
    from jaxserve.measure.bench.load import LoadConfig, run_engine

    workloads = {
        "multi-turn": (DatasetConfig(name="multi-turn", num_prompts=args.conversations * args.turns,
                                     input_len=args.message_len, output_len=args.answer_len, turns=args.turns),
                       LoadConfig(request_rate=math.inf), args.answer_len),
        "shared-prefix": (DatasetConfig(name="shared-prefix", num_prompts=args.shared_prompts,
                                        input_len=args.system_len + args.question_len, output_len=16,
                                        prefix_len=args.system_len,
                                        num_prefixes=2),
                          LoadConfig(request_rate=args.shared_rate), 16),
    }
    workloads = {k: v for k, v in workloads.items() if k in args.workloads.split(",")}
    engines = {caching: LLMEngine(EngineConfig(model=args.model, max_num_seqs=16, max_num_batched_tokens=512,
                                               chunk_size=512, enable_prefix_caching=caching))
               for caching in (True, False)}
    special = tuple(t for t in (engines[True].spec.bos_token_id, engines[True].spec.eos_token_id) if t is not None)
    runs: dict[tuple[str, bool], list] = {}
    for name, (dcfg, load, _) in workloads.items():
        requests = generate(dcfg, min(engines[True].spec.vocab_size, 256), special)
        for rep in range(args.repeats):
            for caching, engine in engines.items():
                run = run_engine(engine, requests, load, salt=f"{name}-{caching}-{rep}")
                runs.setdefault((name, caching), []).append(run)
                print(f"{name} repeat {rep} caching {'on' if caching else 'off'}: "
                      f"{json.dumps(summarize([run], 1024))}", flush=True)
    rows = []
    for (name, caching), setting_runs in runs.items():
        row = {"workload": name, "prefix_caching": caching, **summarize(setting_runs, 1024)}
        if args.profile and caching:
            _, load, out_len = workloads[name]
            concurrency = args.conversations if name == "multi-turn" else None
            rate = args.shared_rate if name == "shared-prefix" else None
            one_run = {**row, "completed": row["completed"] // len(setting_runs)}  # what one repeat served
            row.update(predict_ttft(args.model, args.profile, one_run, concurrency, rate, out_len, engines[True],
                                    [r.arrival for r in setting_runs[0].records]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    for name in workloads:
        on = next(r for r in rows if r["workload"] == name and r["prefix_caching"])
        off = next(r for r in rows if r["workload"] == name and not r["prefix_caching"])
        key = "mean_ttft_long_history_ms" if name == "multi-turn" and on["long_history_requests"] else "mean_ttft_ms"
        per_repeat = [summarize([b], 1024)[key] / summarize([a], 1024)[key]
                      for a, b in zip(runs[(name, True)], runs[(name, False)], strict=True)]
        print(f"{name}: per repeat {', '.join(f'{x:.1f}x' for x in per_repeat)}; pooled "
              f"{key} off/on = {off[key]:.0f}/{on[key]:.0f} ms = {off[key] / on[key]:.1f}x, "
              f"hit rate {on['hit_rate']:.1%}"
              + (f"; mean TTFT on {on['mean_ttft_ms']:.0f} ms, planner {on['predicted_mean_ttft_ms']:.0f} ms "
                 f"(simulated {on['simulated_mean_ttft_ms']:.0f} ms)" if "predicted_mean_ttft_ms" in on else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
