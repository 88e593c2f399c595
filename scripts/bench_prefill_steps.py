"""One prefill step of several prompts against a lone prompt of as many tokens: measured, and the planner's
prediction on a calibrated profile.

    python scripts/bench_prefill_steps.py --profile reports/small-s83/profile.json
    python scripts/bench_prefill_steps.py --profile P --cases 8x512,1x4096 --rounds 5

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
    args = ap.parse_args()

    import numpy as np

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.report.context import ReportConfig
    from planner.api import predict_step

    cases = {c: [int(c.split("x")[1])] * int(c.split("x")[0]) for c in args.cases.split(",")}
    engine = LLMEngine(ReportConfig(model=args.model).engine_config())
    if any(sum(lens) > engine.config.max_num_batched_tokens for lens in cases.values()):
        raise SystemExit(f"a case exceeds one step ({engine.config.max_num_batched_tokens} tokens)")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)
    vocab = engine.spec.vocab_size
    times: dict[str, list[float]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for case, lens in cases.items():
            for i, n in enumerate(lens):
                engine.add_request(f"{case}-{r}-{i}", rng.integers(1, vocab, n).tolist(), params)
            start = time.perf_counter()
            engine.step()
            times[case].append(time.perf_counter() - start)
            while engine.has_unfinished_requests():
                engine.step()
    buckets = tuple(engine.runner.token_buckets)
    for case, lens in cases.items():
        pred = predict_step(args.model, args.profile, prefill_chunks=[(n, 0) for n in lens], dtype="fp32",
                            token_buckets=buckets).total_s
        best = min(times[case])
        print(f"{case}: measured {best * 1e3:.0f} ms (fastest of {[round(t * 1e3) for t in times[case]]}), "
              f"predicted {pred * 1e3:.0f} ms, error {(pred - best) / best:+.1%}")


if __name__ == "__main__":
    main()
