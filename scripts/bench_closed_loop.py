"""The planner against jaxserve's own closed-loop benchmark: N clients with fixed lengths, as
`jaxserve bench serve --max-concurrency N --dataset-name random --request-rate inf` sends them.

For each length mix and N (default 1, 4, 16) one engine runs a benchmark of N x --waves requests through the
driver `bench serve` uses in process (`jaxserve.measure.bench.load.run_engine`, a gate of N clients), and the
planner predicts the same run (`--concurrency N --num-prompts K`) on a calibrated profile: the closed form, and
the simulator beside it. Prints one row per run and the median |error| of mean TTFT, median TTFT and mean
TPOT over the closed-loop rows (targets: 20%, 20%, 10%). `--jitter` adds, per mix, the same N clients
throttled by a Poisson rate at 60% of the predicted loop throughput (vLLM's --request-rate under
--max-concurrency), reported beside the targets.

Usage (2 quiet cores; a loaded machine moves every step):
  jaxserve calibrate --model small --out profile.json
  PYTHONPATH=. python scripts/bench_closed_loop.py --profile profile.json [--repeats 2] [--jitter]
Without --profile it runs `jaxserve calibrate --model small` first and writes the profile beside --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.cli.engine_flags import build_engine  # noqa: E402
from jaxserve.config.engine import EngineConfig  # noqa: E402
from jaxserve.measure.bench.datasets import DatasetConfig, generate  # noqa: E402
from jaxserve.measure.bench.load import LoadConfig, run_engine  # noqa: E402
from jaxserve.measure.bench.results import compute_metrics  # noqa: E402
from jaxserve.measure.calibrate.steps import PromptSource, warm_engine  # noqa: E402
from planner.hardware import load_hardware  # noqa: E402
from planner.serving import ServingConfig, Workload, predict_serving  # noqa: E402
from planner.simulate import simulate  # noqa: E402

MIXES = ((128, 32), (512, 32))  # several prompts a step (cohorts); prompts longer than a step (one stream)


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--profile", default=None, help="a calibrated hardware profile (else calibrate first)")
    ap.add_argument("--out", default="closed_loop_bench.json", help="rows as JSON")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--mixes", default=",".join(f"{i}:{o}" for i, o in MIXES), help="input:output,...")
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens = chunk_size")
    ap.add_argument("--waves", type=int, default=5, help="requests per client (num_prompts = N x waves)")
    ap.add_argument("--min-prompts", type=int, default=8, help="at least this many requests a run")
    ap.add_argument("--repeats", type=int, default=1, help="runs per row (alternating rows), medians reported")
    ap.add_argument("--jitter", action="store_true", help="also N clients under a Poisson rate at 60%% of the loop")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    mixes = [tuple(int(x) for x in m.split(":")) for m in args.mixes.split(",")]

    profile = args.profile
    if profile is None:
        profile = str(Path(args.out).with_name("profile.json"))
        print(f"calibrating {args.model} into {profile} (load {os.getloadavg()[0]:.2f})", flush=True)
        subprocess.run([sys.executable, "-m", "jaxserve", "calibrate", "--model", args.model, "--out", profile],
                       check=True)
    hw = load_hardware(profile)
    config = EngineConfig(model=args.model, dtype="float32", max_num_seqs=max(clients),
                          max_num_batched_tokens=args.budget, chunk_size=args.budget)
    engine = build_engine(config)
    warm_engine(engine, PromptSource(engine, 1))
    spec = engine.spec
    cfg = ServingConfig(max_num_seqs=config.max_num_seqs, chunk_size=args.budget, page_size=config.page_size,
                        dtype="fp32", token_buckets=tuple(engine.runner.token_buckets))

    runs = []  # (mix, n, rate or None)
    for inp, out in mixes:
        runs += [((inp, out), n, None) for n in clients]
        if args.jitter:
            runs.append(((inp, out), max(clients), "jitter"))
    measured: dict[int, list[dict]] = {k: [] for k in range(len(runs))}
    loads: list[tuple[float, float, float]] = []
    salt = int(time.time())
    for rep in range(args.repeats):
        for k, ((inp, out), n, kind) in enumerate(runs):
            num = max(args.min_prompts, n * args.waves)
            wl = Workload(inp, out, concurrency=n, num_prompts=num)
            rate = float("inf")
            if kind == "jitter":
                rate = 0.6 * predict_serving(spec, hw, wl, cfg).requests_per_s
            reqs = generate(DatasetConfig(name="random", num_prompts=num, input_len=inp, output_len=out,
                                          seed=1000 * rep + k), spec.vocab_size,
                            (spec.eos_token_id,) if spec.eos_token_id is not None else ())
            loads.append(os.getloadavg())
            run = run_engine(engine, reqs, LoadConfig(request_rate=rate, max_concurrency=n, seed=rep),
                             salt=f"cl{salt}-{rep}-{k}")
            m = compute_metrics(run.records, run.duration)
            measured[k].append({"mean_ttft_ms": m["mean_ttft_ms"], "median_ttft_ms": m["median_ttft_ms"],
                                "mean_tpot_ms": m["mean_tpot_ms"], "output_throughput": m["output_throughput"],
                                "rate": rate, "failed": m["failed"]})
            print(f"  run {rep + 1}/{args.repeats} {inp}/{out} N={n}{' jitter' if kind else ''}: TTFT mean "
                  f"{m['mean_ttft_ms']:.0f} ms, median {m['median_ttft_ms']:.0f}; TPOT {m['mean_tpot_ms']:.1f} ms "
                  f"(load {loads[-1][0]:.2f})", flush=True)

    rows = []
    for k, ((inp, out), n, kind) in enumerate(runs):
        num = max(args.min_prompts, n * args.waves)
        ms = measured[k]
        meas = {key: median(r[key] for r in ms) for key in ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
                                                            "output_throughput")}
        rate = ms[0]["rate"]
        wl = Workload(inp, out, concurrency=n, num_prompts=num, request_rate=None if kind is None else rate)
        pred = predict_serving(spec, hw, wl, cfg)
        sim = simulate(spec, hw, wl, cfg, seed=1)
        rows.append({"input_len": inp, "output_len": out, "clients": n, "num_prompts": num,
                     "request_rate": None if kind is None else rate, "regime": pred.extra.get("closed_loop"),
                     "measured": meas, "runs": ms,
                     "predicted": {"mean_ttft_ms": pred.ttft.mean, "median_ttft_ms": pred.ttft.p50,
                                   "mean_tpot_ms": pred.tpot.mean, "output_throughput": pred.output_tokens_per_s},
                     "simulated": {"mean_ttft_ms": sim.ttft.mean, "median_ttft_ms": sim.ttft.p50,
                                   "mean_tpot_ms": sim.tpot.mean, "output_throughput": sim.output_tokens_per_s}})

    print(f"\nplanner vs `jaxserve bench serve --max-concurrency N --dataset-name random` ({args.model}, fp32, budget "
          f"{args.budget}, profile {profile}; {args.repeats} run(s) a row, medians)")
    print("| input/output | N | prompts | regime | TTFT mean meas / pred (sim) | err | TTFT median meas / pred (sim)"
          " | err | TPOT meas / pred (sim) | err |")
    print("|---|---:|---:|---|---|---:|---|---:|---|---:|")
    errs: dict[str, list[float]] = {"mean_ttft_ms": [], "median_ttft_ms": [], "mean_tpot_ms": []}
    for r in rows:
        mm, pp, ss = r["measured"], r["predicted"], r["simulated"]
        cells = []
        for key in errs:
            e = _err(pp[key], mm[key])
            if r["request_rate"] is None:
                errs[key].append(abs(e))
            cells.append(f"{mm[key]:.0f} / {pp[key]:.0f} ({ss[key]:.0f}) | {e:+.0%}" if "ttft" in key else
                         f"{mm[key]:.1f} / {pp[key]:.1f} ({ss[key]:.1f}) | {e:+.0%}")
        n = f"{r['clients']}" + ("" if r["request_rate"] is None else f" @ {r['request_rate']:.2f}/s")
        print(f"| {r['input_len']}/{r['output_len']} | {n} | {r['num_prompts']} | {r['regime'] or 'stream'} | "
              + " | ".join(cells) + " |")
    med = {k: median(v) for k, v in errs.items()}
    lo, hi = min(x[0] for x in loads), max(x[0] for x in loads)
    print(f"\nmedian |error| over the {len(errs['mean_ttft_ms'])} closed-loop rows: mean TTFT {med['mean_ttft_ms']:.1%}"
          f" (target <= 20%), median TTFT {med['median_ttft_ms']:.1%} (<= 20%), TPOT {med['mean_tpot_ms']:.1%} "
          f"(<= 10%); machine load (1-min) {lo:.2f}-{hi:.2f} during the runs")
    Path(args.out).write_text(json.dumps({"profile": profile, "budget": args.budget, "rows": rows,
                                          "median_abs_error": med, "load_1min": [x[0] for x in loads]}, indent=1))
    ok = med["mean_ttft_ms"] <= 0.2 and med["median_ttft_ms"] <= 0.2 and med["mean_tpot_ms"] <= 0.1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
