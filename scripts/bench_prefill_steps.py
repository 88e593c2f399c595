"""One prefill step of several prompts against a lone prompt of as many tokens: measured, and the planner's
prediction on a calibrated profile.

    python scripts/bench_prefill_steps.py --profile reports/small-s83/profile.json
    python scripts/bench_prefill_steps.py --profile P --cases 8x512,1x4096 --rounds 5
    python scripts/bench_prefill_steps.py --profile P --cases 1x128,1x256 --decodes 0,1,4,8 --quantization int8

`--decodes D,...`: each case also with D sequences decoding beside its prompts (the Poisson loads' prefill steps:
one 128-token prompt beside a few decodes runs padded to the next bucket, 192 on the half-octave ladder).

Runs the engine `jaxserve report` uses (`ReportConfig().engine_config()`: one step holds 4160 tokens, a
half-octave token ladder), prefills each case's prompts (fresh random tokens, one output token) in one step,
`--rounds` times in alternating order, and prints the fastest step of each case beside `planner.predict_step` for
the same chunks and buckets. The report's grid steps are of the first kind (16 prompts of 128 or 512 tokens),
calibrate's prefills of the second.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--profile", required=True, help="calibrated hardware profile (e.g. from jaxserve report)")
    ap.add_argument("--cases", default="8x512,1x4096,4x512,1x2048,2x1024,1x3072,6x512",
                    help="COUNTxTOKENS prompts per step, comma separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decodes", default="0", help="decoding sequences beside each case's prompts, comma separated")
    ap.add_argument("--quantization", default=None, help="int8 | fp8 weights (the profile must be calibrated so)")
    args = ap.parse_args()

    import numpy as np

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.measure.calibrate.calibrate import planner_dtypes
    from jaxserve.measure.report.context import ReportConfig
    from planner.api import predict_step

    decodes = [int(d) for d in args.decodes.split(",")]
    cases = {(c, d): [int(c.split("x")[1])] * int(c.split("x")[0]) for c in args.cases.split(",") for d in decodes}
    engine = LLMEngine(ReportConfig(model=args.model, quantization=args.quantization).engine_config())
    if any(sum(lens) + d > engine.config.max_num_batched_tokens for (_, d), lens in cases.items()):
        raise SystemExit(f"a case exceeds one step ({engine.config.max_num_batched_tokens} tokens)")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    rng = np.random.default_rng(0)
    vocab, context = engine.spec.vocab_size, 100
    times: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for (case, d), lens in cases.items():
            running = [f"{case}-{d}-{r}-dec{i}" for i in range(d)]
            for rid in running:  # prefilled, then one decode step, before the timed step
                engine.add_request(rid, rng.integers(1, vocab, context).tolist(), long)
            for _ in range(2 if d else 0):
                engine.step()
            for i, n in enumerate(lens):
                engine.add_request(f"{case}-{d}-{r}-{i}", rng.integers(1, vocab, n).tolist(), params)
            start = time.perf_counter()
            engine.step()
            times[(case, d)].append(time.perf_counter() - start)
            for rid in running:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
    buckets = tuple(engine.runner.token_buckets)
    dtype, kv_dtype = planner_dtypes(engine)
    for (case, d), lens in cases.items():
        # each decode had its prompt and one token cached when the timed step ran
        pred = predict_step(args.model, args.profile, [context + 1] * d, prefill_chunks=[(n, 0) for n in lens],
                            dtype=dtype, kv_dtype=kv_dtype, token_buckets=buckets).total_s
        best = min(times[(case, d)])
        print(f"{case} beside {d} decodes: measured {best * 1e3:.0f} ms (fastest of "
              f"{[round(t * 1e3) for t in times[(case, d)]]}), predicted {pred * 1e3:.0f} ms, "
              f"error {(pred - best) / best:+.1%}")


if __name__ == "__main__":
    main()
