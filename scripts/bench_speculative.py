"""One request's TPOT with speculative decoding against without, alternating in one process.

Engines of the same target: plain, n-gram lookup and a draft model (when --draft-model names one); with
--async-scheduling also a plain engine and each speculative one on the overlapped loop (up to five). The
prompts: a passage the answer copies (n-gram's case: with a trained model, "repeat the passage"; with a synthetic
one, a repeated phrase), an ordinary one (the draft model's case) and, for a model that ships held_out.txt
(bard), the opening of a held-out passage (text neither model trained on). Each round runs every (engine, prompt) pair
once, greedy, --output-len tokens; the figures are medians over --rounds rounds after one warm round. Beside each
TPOT: the acceptance rate, the tokens per verify step, and the planner's TPOT for the measured acceptance and its
choice of k (`planner.speculative`, on --profile, a calibrated hardware profile, when given).

With --paired each speculative run is paired with a plain run of the same prompt right before or after it (order
alternating by round), and the row adds the median of the pairs' TPOT ratios: on a shared machine whose load moves
between rounds this ratio is steadier than a ratio of medians. With --async-scheduling a plain engine with the
overlapped loop joins too, and each overlapped speculative engine is compared with it (`baseline`), not with the
synchronous one: the overlap's own gain is not speculation's.

With --time-round N, each speculative engine's fused round (one sequence's bucket) is also timed against the
target's one-token forward and against a whole plain step (the forward, then the sampler's LM head and draw), all
on no sequence, alternating N times: what the round's device program costs over a plain decode's; the round and
the plain step also with ~0.3 ms of host Python work between dispatch and wait (what the overlapped loop hides).

    python scripts/bench_speculative.py --model bard --draft-model bard-draft --k 4 --profile P --out reports/spec.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from jaxserve.config.engine import EngineConfig  # noqa: E402
from jaxserve.core.batch import empty_batch  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.engine.factory import create_engine  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.platform.kernel_choice import host_work  # noqa: E402
from jaxserve.runner.sampler import SamplingArrays  # noqa: E402
from modelspec.spec import load_model_spec, resolve_model_path  # noqa: E402
from planner.hardware import load_hardware  # noqa: E402
from planner.speculative import acceptance_from_tokens_per_step, choose_k, predict_speculative  # noqa: E402

PASSAGE = ("The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp, and wrote in his log that "
           "the sea was calm, the wind came from the west, and three fishing boats had returned before dark. ")


def prompts(engine: LLMEngine, prompt_len: int) -> dict[str, list[int]]:
    """The copy task, an ordinary prompt and (a shipped model) a held-out passage's first 32 tokens, as token ids."""
    if engine.spec.synthetic:  # no language: a repeated phrase stands for the passage the answer copies
        phrase = list(range(7, 31))
        copy = (phrase * (prompt_len // len(phrase) + 1))[:prompt_len]
        plain = [(i * 37 + 11) % 250 for i in range(prompt_len)]
        return {"copy": copy, "plain": plain}
    tok = engine.tokenizer
    passage = PASSAGE * max(1, prompt_len // max(1, len(tok.encode(PASSAGE))))
    out = {"copy": engine.tokenize_prompt(f"{passage}\nRepeat the passage above exactly.\n\n{passage[:40]}"),
           "plain": engine.tokenize_prompt("Once upon a time, in a small village by the sea,")}
    held = Path(resolve_model_path(engine.config.model)) / "held_out.txt"
    if held.is_file():
        out["held-out"] = tok.encode(held.read_text()[:2000])[:32]
    return out


BASELINES = ("plain", "plain-async")


def keep_a_round(engine: LLMEngine) -> list:
    """The inputs of every round `engine` prepares from now on (for `time_round` to replay one)."""
    rnd, kept = engine.loop.round, []
    prepare = rnd.prepare

    def keeping(*args, **kwargs):
        kept.append(prepare(*args, **kwargs))
        return kept[-1]
    rnd.prepare = keeping
    return kept


def time_round(engine: LLMEngine, repeats: int, real: object = None) -> dict:
    """A speculative engine's fused round (its smallest sequence bucket) against the target's one-token forward and
    against a whole plain step (that forward and the sampler's LM head and draw: what a plain decode dispatches),
    all on no sequence (every write to the trash page), alternating: the device program's cost, host excluded but
    for the calls themselves. `real`: a round the engine ran on a request's sequence (`keep_a_round`), replayed
    as it was laid out (its KV written to the same slots again; chained rounds without their carry), whose
    attention reads that sequence's history: `real_round_us`, `real_round_over_plain_step`. The round and the
    plain step are also timed with a fixed amount of host Python work (`kernel_choice.host_work`, ~0.3 ms alone)
    run between their dispatch and the wait, as the overlapped loop runs its host work: what the overlap hides of
    each on this machine. Medians in microseconds."""
    rnd, runner = engine.loop.round, engine.runner
    inputs = rnd.idle_inputs(rnd.sizes[0])
    sampling = SamplingArrays.build([], runner.sampling_bucket(1))
    work = host_work()
    calls = {"round": lambda: rnd.dispatch(inputs)[0], "forward": lambda: runner.forward(empty_batch()),
             "plain_step": lambda: runner.dispatch(empty_batch(), sampling)}
    if real is not None:
        calls["real_round"] = lambda: rnd.dispatch(real)[0]
    beside = {f"{name}_beside_host": (calls[name], work) for name in ("round", "plain_step")}
    timed = {**{name: (f, None) for name, f in calls.items()}, **beside, "host_alone": (lambda: None, work)}
    times: dict[str, list[float]] = {name: [] for name in timed}
    for i in range(repeats + 10):
        for name in (timed if i % 2 else reversed(timed)):
            f, then = timed[name]
            t = time.perf_counter()
            out = f()
            if then is not None:
                then()
            jax.block_until_ready(out)
            if i >= 10:  # after warm calls
                times[name].append(time.perf_counter() - t)
    got = {f"{name}_us": 1e6 * statistics.median(v) for name, v in times.items()}
    if real is not None:
        got["real_round_over_plain_step"] = got["real_round_us"] / got["plain_step_us"]
    return {**got, "round_over_forward": got["round_us"] / got["forward_us"],
            "round_over_plain_step": got["round_us"] / got["plain_step_us"], "round_rows": inputs.has_draft.size}


def baseline(name: str) -> str:
    """The plain engine a speculative one is compared with: the one with the same host loop."""
    return "plain-async" if name.endswith("-async") else "plain"


def one(engine: LLMEngine, ids: list[int], n: int, rid: str) -> dict:
    """One greedy request of `n` tokens: its TPOT, draft counts, engine steps, chained rounds (overlapped
    speculation's rounds dispatched behind the one in flight), empty rounds (those that verified no draft) and
    tokens."""
    counters = getattr(engine.loop, "counters", None)
    chained, empty = (counters.num_chained, counters.num_empty) if counters is not None else (0, 0)
    engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out, steps = None, 0
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            out = o if o.finished else out
    m = out.metrics
    return {"tpot_ms": 1e3 * m.tpot, "drafts": m.spec_num_draft_tokens, "accepted": m.spec_num_accepted_tokens,
            "verify_steps": m.spec_num_steps, "engine_steps": steps,
            "chained_rounds": (counters.num_chained - chained) if counters is not None else 0,
            "empty_rounds": (counters.num_empty - empty) if counters is not None else 0,
            "tokens": len(out.token_ids), "token_ids": list(out.token_ids)}


def run_rounds(engines: dict[str, LLMEngine], tasks: dict[str, list[int]], rounds: int, n: int, paired: bool
               ) -> tuple[dict[tuple[str, str], list[dict]], dict[tuple[str, str], list[float]]]:
    """Every (engine, task) once a round after one warm round. Paired: each speculative run beside its own plain
    run, plain first in even rounds and last in odd ones; returns the runs and, paired, each pair's TPOT ratio."""
    runs: dict[tuple[str, str], list[dict]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}

    def timed(name: str, task: str, r: int) -> dict:
        engines[name].kv_manager.reset_prefix_cache()
        res = one(engines[name], tasks[task], n, f"{name}-{task}-{r}-{len(runs.get((name, task), []))}")
        if r:
            runs.setdefault((name, task), []).append(res)
        return res

    for r in range(rounds + 1):
        for task in tasks:
            if not paired:
                for name in engines:
                    timed(name, task, r)
                continue
            for name in (x for x in engines if x not in BASELINES):
                order = [baseline(name), name] if r % 2 == 0 else [name, baseline(name)]
                got = {who: timed(who, task, r) for who in order}
                if r:
                    ratios.setdefault((name, task), []).append(got[name]["tpot_ms"] / got[baseline(name)]["tpot_ms"])
    return runs, ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--async-scheduling", action="store_true",
                    help="also each speculative method with --async-scheduling (rounds chained on the device)")
    ap.add_argument("--profile", default=None, help="hardware profile for the planner (jaxserve calibrate)")
    ap.add_argument("--paired", action="store_true",
                    help="pair every speculative run with a plain run of the same prompt; report the median ratio")
    ap.add_argument("--time-round", type=int, default=0, metavar="N",
                    help="also time each speculative engine's fused round against its one-token forward and a "
                         "whole plain step, alone and beside host work, N times")
    ap.add_argument("--no-warmup", action="store_true",
                    help="engines compile each shape when they first run it, not at start-up (a quick check of "
                         "the script: the first round's figures then include compiles)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    base = dict(model=a.model, max_num_seqs=4, max_num_batched_tokens=512, chunk_size=512, warmup=not a.no_warmup)
    methods = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": a.k,
                                        "prompt_lookup_max": a.prompt_lookup_max,
                                        "prompt_lookup_min": a.prompt_lookup_min}}
    if a.draft_model:
        methods["draft_model"] = {"method": "draft_model", "model": a.draft_model, "num_speculative_tokens": a.k}
    configs = {name: EngineConfig(**base, speculative_config=sc) for name, sc in methods.items()}
    if a.async_scheduling:
        configs.update({f"{name}-async": EngineConfig(**base, speculative_config=sc, async_scheduling=True)
                        for name, sc in methods.items()})
    t0 = time.monotonic()
    engines = {name: create_engine(config) for name, config in configs.items()}
    print(f"engines ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    tasks = prompts(engines["plain"], a.prompt_len)
    kept = {name: keep_a_round(eng) for name, eng in engines.items() if a.time_round and name not in BASELINES}
    runs, ratios = run_rounds(engines, tasks, a.rounds, a.output_len, a.paired)
    hw = load_hardware(a.profile) if a.profile else None
    spec = engines["plain"].spec
    draft = load_model_spec(a.draft_model) if a.draft_model else None
    rows = []
    for (name, task), rs in runs.items():
        tpot = statistics.median(x["tpot_ms"] for x in rs)
        base_runs = runs[(baseline(name), task)]
        peers = base_runs + runs[("plain", task)]
        plain = statistics.median(x["tpot_ms"] for x in base_runs)
        drafts, acc, steps = (sum(x[k] for x in rs) for k in ("drafts", "accepted", "verify_steps"))
        row = {"method": name, "task": task, "baseline": baseline(name), "tpot_ms": tpot,
               "tpot_runs_ms": [x["tpot_ms"] for x in rs], "plain_tpot_ms": plain, "speedup": plain / tpot,
               "speedup_vs_synchronous_plain": statistics.median(x["tpot_ms"] for x in runs[("plain", task)]) / tpot,
               "tpot_ratio_median_of_pairs": statistics.median(ratios[name, task]) if (name, task) in ratios else None,
               "same_tokens": all(x["token_ids"] == y["token_ids"] for x in rs for y in peers),
               "acceptance_rate": acc / drafts if drafts else None,
               "engine_steps_per_request": statistics.median(x["engine_steps"] for x in rs),
               "chained_rounds_per_request": statistics.median(x["chained_rounds"] for x in rs),
               "empty_rounds_per_request": statistics.median(x["empty_rounds"] for x in rs),
               "verify_steps_per_request": statistics.median(x["verify_steps"] for x in rs),
               "tokens_per_verify_step": 1 + acc / steps if steps else None}
        if hw is not None and name not in BASELINES and steps:
            e = 1 + acc / steps
            alpha = acceptance_from_tokens_per_step(min(e, a.k + 1), a.k)
            kw = dict(method=name.removesuffix("-async"), draft=draft, context_len=a.prompt_len + a.output_len / 2,
                      dtype="fp32", token_buckets=engines[name].runner.token_buckets)
            pred = predict_speculative(spec, hw, k=a.k, acceptance=alpha, **kw)
            row.update(acceptance_per_draft=alpha, planner_tpot_ms=pred.tpot_s * 1e3,
                       planner_plain_tpot_ms=pred.decode_step_s * 1e3, planner_best_k=choose_k(
                           spec, hw, acceptance=alpha, **kw).k)
        rows.append(row)
        print(json.dumps(row), flush=True)
    # the middle one of the rounds the engine ran stands for a round on a request's sequence
    timings = {name: time_round(eng, a.time_round, kept[name][len(kept[name]) // 2] if kept[name] else None)
               for name, eng in engines.items() if a.time_round and name not in BASELINES}
    for name, r in timings.items():
        print(json.dumps({"round_timing": name, **r}), flush=True)
    result = {"model": a.model, "draft_model": a.draft_model, "k": a.k, "prompt_len": a.prompt_len,
              "output_len": a.output_len, "rounds": a.rounds, "paired": a.paired, "profile": a.profile, "rows": rows,
              "round_timing": timings, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
