"""TPOT with several decode steps a dispatch: one engine per `--num-scheduler-steps` value, alternating in one process.

    python scripts/bench_decode_steps.py --model small --steps 1,4,8 --batches 1,16 --rounds 5

Each round runs every engine on the same prompts (greedy, `--output-len` tokens, ignore_eos) and records the mean
TPOT over the batch; the table shows each engine's median over rounds and its ratio to the first engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from jaxserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", default="1,4,8", help="--num-scheduler-steps values, comma-separated")
    ap.add_argument("--batches", default="1,16", help="concurrent requests, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the medians as JSON here")
    args = ap.parse_args()
    steps = [int(k) for k in args.steps.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    budget = max(256, max(batches) * args.prompt_len)
    llms = {k: LLM(model=args.model, num_scheduler_steps=k, max_num_seqs=max(batches), max_num_batched_tokens=budget,
                   chunk_size=budget) for k in steps}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    tpot: dict[tuple[int, int], list[float]] = {(k, b): [] for k in steps for b in batches}
    for r in range(args.rounds):
        for b in batches:
            prompts = [[(7 * r + 13 * i + j) % 250 + 1 for j in range(args.prompt_len)] for i in range(b)]
            for k, llm in llms.items():
                outs = llm.generate(prompts, params)
                tpot[k, b].append(1e3 * statistics.mean(o.metrics.tpot for o in outs))
    load = os.getloadavg()[0]
    print(f"{args.model}, {args.prompt_len}-token prompts, {args.output_len} tokens, {args.rounds} rounds "
          f"(load {load:.2f})")
    print("requests  " + "  ".join(f"k={k:<2} TPOT ms (x k={steps[0]})" for k in steps))
    result = {}
    for b in batches:
        base = statistics.median(tpot[steps[0], b])
        cells = []
        for k in steps:
            med = statistics.median(tpot[k, b])
            result[f"{b}x k={k}"] = med
            cells.append(f"{med:8.2f} ({med / base:.3f})      ")
        print(f"{b:>8}  " + "  ".join(cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "tpot_ms": result, "load": load}, f, indent=2)


if __name__ == "__main__":
    main()
