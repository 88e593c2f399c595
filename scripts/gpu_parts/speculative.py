"""Part `speculative` (issue 46 item 4): n-gram speculation on synthetic-1b with a copy task, TPOT with and without.

A repeated 24-token phrase as the prompt (a random model has no language: its greedy answer falls into the
phrase, which prompt lookup then proposes), greedy, one request. Engines: no speculation with the default loop
and with the synchronous loop (speculation runs on that one), and n-gram (4 proposals, lookup 4..1). Rounds
alternate the engines; TPOT is the median over rounds after a warm one. Also the acceptance rate and whether the
tokens equal plain decoding's. Target (issue 46, on a CPU): n-gram <= 0.45x the TPOT of no speculation.
"""

from __future__ import annotations

import time

import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from scripts.gpu_parts.common import Part, engine_args, greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
ENGINES = (("plain default loop", {}), ("plain synchronous", {"async_scheduling": False}),
           ("ngram", {"speculative_config": NGRAM}))


def copy_prompt(length: int) -> list[int]:
    phrase = list(range(7, 31))
    return (phrase * (length // len(phrase) + 1))[:length]


def one(engine: LLMEngine, ids: list[int], n: int, rid: str) -> dict:
    engine.add_request(rid, ids, greedy(n))
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    m = out.metrics
    return {"tpot_ms": 1e3 * m.tpot, "drafts": m.spec_num_draft_tokens, "accepted": m.spec_num_accepted_tokens,
            "tokens": list(out.outputs[0].token_ids)}


def main() -> None:
    part = Part("speculative", __doc__.splitlines()[0], 45)
    s = part.sizes
    engines: dict[str, LLMEngine] = {}
    for name, overrides in ENGINES:
        def build(name=name, overrides=overrides) -> dict:
            t = time.perf_counter()
            engines[name] = e = LLMEngine(EngineConfig(**engine_args(s, **overrides)))
            return {"build_s": time.perf_counter() - t, "loop": e.loop.name}

        part.run(f"{name} engine", build, need_s=10)
    prompt = copy_prompt(s.spec_prompt)
    runs: dict[str, list[dict]] = {name: [] for name in engines}

    def round_(r: int) -> dict:
        for name, e in engines.items():
            runs[name].append(one(e, prompt, s.spec_tokens, f"{name}-{r}"))
        return {name: round(v[-1]["tpot_ms"], 4) for name, v in runs.items()}

    for r in range(s.reps + 1):  # the first round warms every engine
        if part.run(f"round {r}", lambda r=r: round_(r), need_s=5) is None:
            break
    tpot = {name: float(np.median([x["tpot_ms"] for x in v[1:]])) for name, v in runs.items() if len(v) > 1}
    part.record["results"]["tpot_ms"] = tpot
    if "ngram" in runs and runs["ngram"]:
        last = runs["ngram"][-1]
        plain = runs.get("plain synchronous") or runs.get("plain default loop") or [{}]
        part.record["results"]["ngram"] = {
            "acceptance": last["accepted"] / max(1, last["drafts"]), "drafts": last["drafts"],
            "same_tokens_as_plain": last["tokens"] == plain[-1].get("tokens")}
    for base in ("plain default loop", "plain synchronous"):
        value = tpot["ngram"] / tpot[base] if "ngram" in tpot and base in tpot else None
        part.figure(f"n-gram TPOT / {base} TPOT, copy task", value, "x", "<=", 0.45, "46")
    part.finish()


if __name__ == "__main__":
    main()
