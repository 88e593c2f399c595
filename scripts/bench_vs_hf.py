"""Head-to-head on this CPU: jaxserve vs HF transformers (torch) on the same random-weight Llama.

Measures, for the `small` preset (or --model): one request end to end (prefill + decode), and decode step time
at several concurrencies. HF runs `generate` with static batches (greedy, KV cache on); jaxserve runs
`LLM.generate` with the same prompts. Prints a table and writes JSON.

    python scripts/bench_vs_hf.py --out reports/bench_vs_hf.json
    python scripts/bench_vs_hf.py --async-scheduling --out reports/bench_vs_hf_async.json
    python scripts/bench_vs_hf.py --num-scheduler-steps 4 --out reports/bench_vs_hf_k4.json
    python scripts/bench_vs_hf.py --profile reports/profile.json   # also: TPOT against the bandwidth floor

With `--profile` (from `jaxserve calibrate`), each row also gets the decode floor: the bytes one step reads
(weights, plus every sequence's KV at its mean context over the run) over the profile's measured memory
bandwidth, and the measured TPOT as a multiple of it. With `--measure-bandwidth` the bandwidth is measured
instead right around each timed run (calibrate's 1 GiB streaming sum, just before and just after, and the CPU
matmul kernel's one-row read over a 1 GiB matrix just after; the floor uses the higher of the sum's mean and that
read), so the floor and the TPOT see the same machine: its streaming sum read 39 to 64 GB/s within ten minutes on
2026-11-30.

    python scripts/bench_vs_hf.py --skip-hf --batches 1 --measure-bandwidth --async-scheduling --repeats 10

`--repeats N` runs each engine N timed times per batch after one warm-up run of the same prompts, all in the same
process. jaxserve and llama.cpp take turns, round by round (the first of a round alternating), each run with its
own bandwidth measurement and floor: on a machine whose bandwidth drifts over minutes (a Zen 3 EPYC's streaming
sum read 22.7 GB/s before a breakdown's jaxserve part and 27.2 after its llama.cpp part, docs/results.md), a ratio
of runs minutes apart measured the machine as much as the engines. HF runs after both (its torch threads beside
jaxserve's slowed jaxserve's step), and llama.cpp's GGUF and HF's reference tokens are made in a child process
before jaxserve starts, so without HF the benchmark's process never loads torch. A row holds each engine's
medians (TPOT, end to end, TPOT / floor each on its own), every run under "runs", "hf_runs" and "llamacpp_runs",
the ratio of medians (`speedup_vs_llamacpp_e2e`) and the median of the rounds' paired ratios
(`speedup_vs_llamacpp_e2e_paired`), so one slow sample of any engine cannot decide a ratio. Each run
records the machine's one-minute load average after it (`*_load_1m`): llama.cpp's threads wait for each other
spinning, and on a shared machine its step slowed tenfold and more where jaxserve's slowed under twofold
(docs/tuning.md), so a ratio holds only for runs at the same, low load.

The output starts with the CPU's instruction set, the one jaxserve's kernels were built for and the engine's
kernel plan (the row counts whose matmuls run in the kernel). `--kernel-variant avx2` builds and runs the AVX2
kernels on an AVX-512 machine (same cores, half the vector width: an emulation of an AVX2-only CPU; XLA's and
torch's own code still use AVX-512); `--no-cpu-kernels` keeps jaxserve in XLA's code.

    python scripts/bench_vs_hf.py --batches 1 --prompt-len 128 --kernel-variant avx2

`--llamacpp --llamacpp-src DIR` adds llama.cpp as a second peer (scripts/llamacpp_peer.py): HF's model converted
to GGUF F32 by llama.cpp's own converter (DIR: llama.cpp's source, e.g. llama-cpp-python's sdist's
`vendor/llama.cpp`), all of a row's sequences decoded in one llama.cpp batch, greedy, with `--threads` threads.

    python scripts/bench_vs_hf.py --batches 1,16 --llamacpp --llamacpp-src /tmp/llama.cpp
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np


def medians(run: Callable[[], dict[str, float]], repeats: int) -> tuple[dict[str, float], list[dict[str, float]]]:
    """`run()` once untimed (the same shapes: caches, threads, allocations), then `repeats` times: the median of
    each of its figures, and every run."""
    run()
    runs = [run() for _ in range(repeats)]
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}, runs


def decode_floor(spec, batch: int, mean_context: float, bandwidth: float, tpot_s: float) -> dict:
    """A decode step's bytes (weights once, each sequence's KV) over `bandwidth`, and TPOT as a multiple of it."""
    from modelspec.memory import kv_bytes_per_token, weight_bytes_per_device

    step_bytes = weight_bytes_per_device(spec, "fp32") + batch * mean_context * kv_bytes_per_token(spec, "fp32")
    floor = step_bytes / bandwidth
    return {"bandwidth_gbps": bandwidth / 1e9, "step_mb": step_bytes / 1e6, "floor_ms": floor * 1e3,
            "tpot_over_floor": tpot_s / floor}


CHECK_TOKENS = 16  # llama.cpp's first greedy tokens checked against HF's, so both run the same model


def hf_rows(hf, rows: list[dict], prompt_sets: list[list[list[int]]], args) -> None:
    """Time HF's `generate` on each row's prompts as jaxserve's are timed: a warm-up, `--repeats` runs, medians.
    A run's TPOT is its end to end less a one-token run's, over the other tokens."""
    from hf_peer import hf_run

    def run(prompts: list[list[int]]) -> dict[str, float]:
        e2e = hf_run(hf, prompts, args.new_tokens)
        prefill = hf_run(hf, prompts, 1)
        return {"hf_e2e_s": e2e, "hf_tpot_ms": (e2e - prefill) / (args.new_tokens - 1) * 1e3, "hf_prefill_s": prefill,
                "hf_load_1m": os.getloadavg()[0]}

    for row, prompts in zip(rows, prompt_sets, strict=True):
        res, runs = medians(lambda prompts=prompts: run(prompts), args.repeats)
        row.update(res, hf_tokens_per_s=row["batch"] * args.new_tokens / res["hf_e2e_s"],
                   speedup_e2e=res["hf_e2e_s"] / row["jaxserve_e2e_s"])
        if args.repeats > 1:
            row["hf_runs"] = runs
        print(json.dumps(row), flush=True)


def timed_with_floor(run: Callable[[], dict[str, float]], spec, batch: int, args, bandwidth: float | None,
                     prefix: str) -> tuple[dict[str, float], float | None]:
    """`run()` (its TPOT under f"{prefix or 'jaxserve_'}tpot_ms"), with `--measure-bandwidth`'s bandwidth measured
    just before and after it (the higher of the streaming sum's mean and the kernel's own best read) and its floor
    under `prefix`. Returns (the figures, the bandwidth now)."""
    from jaxserve.measure.calibrate.microbench import measure_bandwidth, measure_weight_read

    before = measure_bandwidth(2**30) if args.measure_bandwidth else None
    res = run()
    if before is not None:
        bandwidth = max((before + measure_bandwidth(2**30)) / 2, measure_weight_read(2**30) or 0.0)
    if bandwidth:
        floor = decode_floor(spec, batch, args.prompt_len + args.new_tokens / 2, bandwidth,
                             res[f"{prefix or 'jaxserve_'}tpot_ms"] / 1e3)
        res.update({f"{prefix}{k}": v for k, v in floor.items()})
    return res, bandwidth


def jaxserve_run(llm, prompts: list[list[int]], params, new_tokens: int) -> dict[str, float]:
    """One timed `LLM.generate` of `prompts`, every prompt prefilled (the prefix cache emptied first)."""
    llm.engine.kv_manager.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    return {"jaxserve_e2e_s": wall, "jaxserve_tpot_ms": float(np.mean([o.metrics.tpot for o in outs])) * 1e3,
            "jaxserve_tokens_per_s": len(prompts) * new_tokens / wall,
            "jaxserve_ttft_ms": float(np.mean([o.metrics.ttft for o in outs])) * 1e3,
            "jaxserve_load_1m": os.getloadavg()[0]}


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--async-scheduling", action="store_true", help="jaxserve schedules one step ahead")
    ap.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="jaxserve runs this many decode steps a dispatch while every request decodes")
    ap.add_argument("--profile", default=None, help="calibrated hardware profile: report TPOT / bandwidth floor")
    ap.add_argument("--measure-bandwidth", action="store_true",
                    help="floor from bandwidth measured just before and after each timed run (not --profile's)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs per batch of each engine, after a warm-up (jaxserve's each with its own "
                         "bandwidth); a row holds their medians")
    ap.add_argument("--kernel-variant", default="native", choices=("native", "avx2", "portable"),
                    help="which build of jaxserve's CPU kernels to load (cpu_kernels.VARIANTS)")
    ap.add_argument("--no-cpu-kernels", action="store_true", help="jaxserve in XLA's code only")
    ap.add_argument("--llamacpp", action="store_true", help="also llama.cpp (llama-cpp-python) on a GGUF F32 copy")
    ap.add_argument("--llamacpp-src", default=None, help="llama.cpp's source folder (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.llamacpp and not (args.llamacpp_src and Path(args.llamacpp_src, "convert_hf_to_gguf.py").exists()):
        ap.error("--llamacpp needs --llamacpp-src pointing at llama.cpp's source (with convert_hf_to_gguf.py)")

    from jaxserve import LLM, SamplingParams
    from jaxserve.kernels.cpu import library as cpu_kernels
    from modelspec.spec import load_model_spec

    if not args.no_cpu_kernels and not cpu_kernels.load(cpu_kernels.CACHE_DIR, args.kernel_variant):
        ap.error(f"the {args.kernel_variant} build of jaxserve's CPU kernels is not available")

    spec = load_model_spec(args.model)
    bandwidth = None
    if args.profile:
        with open(args.profile) as f:
            bandwidth = json.load(f)["memory_bandwidth_gbps"] * 1e9
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    prompt_sets = [[rng.integers(0, 256, args.prompt_len).tolist() for _ in range(b)] for b in batches]
    peer_dir = tempfile.TemporaryDirectory() if args.llamacpp else None
    if peer_dir is not None:  # before jaxserve starts: the child's torch has the cores to itself
        from llamacpp_peer import LlamaCppRunner, prepare_in_child

        gguf, hf_first = prepare_in_child(args.model, Path(args.llamacpp_src), Path(peer_dir.name), prompt_sets,
                                          CHECK_TOKENS, args.threads)
    rows = []
    llm = LLM(model=args.model, max_num_seqs=max(batches), max_num_batched_tokens=2048, chunk_size=512,
              async_scheduling=args.async_scheduling, num_scheduler_steps=args.num_scheduler_steps,
              cpu_kernels=not args.no_cpu_kernels)
    plan = llm.engine.runner.ops.matmul.plan
    machine = {"machine_isa": cpu_kernels.machine_isa(), "kernel_variant": args.kernel_variant,
               "kernel_isa": None if args.no_cpu_kernels else cpu_kernels.isa(),
               "kernel_plan": plan.describe() if plan else "XLA only"}
    print(json.dumps(machine), flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    for i, (b, prompts) in enumerate(zip(batches, prompt_sets, strict=True)):
        runner = (LlamaCppRunner(gguf, b, args.prompt_len + args.new_tokens, args.threads)
                  if peer_dir is not None else None)
        engines = {"jaxserve": (lambda p=prompts: jaxserve_run(llm, p, params, args.new_tokens), "")}
        if runner is not None:
            engines["llamacpp"] = (lambda r=runner, p=prompts: {**r.generate(p, args.new_tokens),
                                                                "llamacpp_load_1m": os.getloadavg()[0]}, "llamacpp_")
        for run, _ in engines.values():  # warm: the same shapes, as many steps
            run()
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
        for r in range(args.repeats):
            # The engines take turns, the first of a round alternating, so a drift in the machine's bandwidth
            # over the minutes of a row falls on both.
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                run, prefix = engines[name]
                res, bandwidth = timed_with_floor(run, spec, b, args, bandwidth, prefix)
                runs[name].append(res)
        row = {"batch": b, **median_of(runs["jaxserve"])}
        if len(runs["jaxserve"]) > 1:
            row["runs"] = runs["jaxserve"]
        if runner is not None:
            same = sum(a == c for ref, out in zip(hf_first[i], runner.tokens, strict=True)
                       for a, c in zip(ref, out[:CHECK_TOKENS], strict=True))
            peer = median_of(runs["llamacpp"])
            paired = [p["llamacpp_e2e_s"] / j["jaxserve_e2e_s"]
                      for j, p in zip(runs["jaxserve"], runs["llamacpp"], strict=True)]
            row.update(peer, llamacpp_first16_match_hf=same / (CHECK_TOKENS * b),
                       llamacpp_tokens_per_s=b * args.new_tokens / peer["llamacpp_e2e_s"],
                       speedup_vs_llamacpp_e2e=peer["llamacpp_e2e_s"] / row["jaxserve_e2e_s"],
                       speedup_vs_llamacpp_e2e_paired=float(np.median(paired)))
            if args.repeats > 1:
                row["llamacpp_runs"] = runs["llamacpp"]
            runner.close()
        rows.append(row)
        if args.skip_hf:
            print(json.dumps(row), flush=True)
    if peer_dir is not None:
        peer_dir.cleanup()
    if not args.skip_hf:
        del llm
        from hf_peer import hf_model

        hf_rows(hf_model(spec, args.threads), rows, prompt_sets, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "async_scheduling": args.async_scheduling,
                       "num_scheduler_steps": args.num_scheduler_steps, **machine,
                       "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
