"""Issue 40's targets against a real `jaxserve serve` process (default model bard):

1. /health latency while 20 distinct ~20 KB JSON schemas compile at once (target <= 100 ms), three rounds;
2. the server's RSS after 50 distinct pathological regexes, half just under max_repeat (compiled), half past it
   (refused), against its RSS at start (target: within 300 MB);
3. every hostile class (constraints past the limits, malformed tools, deep bodies, unsatisfiable constraints,
   underflowing sampling values): no process death, no 5xx;
4. `tool_choice: "required"` (parallel and not) and a named function with an unbounded integer: the share of
   runs whose calls parse, and their finish_reason (target: every run).

Usage: python scripts/bench_hostile_grammars.py [--model bard] [--runs 20]. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.hostile_grammars import (  # noqa: E402
    ADD,
    CHAT,
    COMPLETIONS,
    NOTE,
    HealthProbe,
    ServeProcess,
    deep_body,
    malformed_tools,
    past_the_limits,
    repetition_regex,
    wide_schema,
)

MB = 2**20


def post(url: str, path: str, body: dict | bytes, timeout: float = 120) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=timeout)
    return httpx.post(url + path, json=body, timeout=timeout)


def health_while_compiling(server: ServeProcess, rounds: int = 3, count: int = 20) -> dict:
    out = []
    for r in range(rounds):
        bodies = [{"prompt": "x", "max_tokens": 4, "guided_json": wide_schema(1000 * (r + 1) + i)}
                  for i in range(count)]
        with HealthProbe(server.url, interval=0.01) as probe, ThreadPoolExecutor(count) as pool:
            t = time.perf_counter()
            statuses = list(pool.map(lambda b: post(server.url, COMPLETIONS, b).status_code, bodies))
            wall = time.perf_counter() - t
        lat = sorted(probe.latencies)
        out.append({"statuses": sorted(set(statuses)), "wall_s": round(wall, 2), "probes": len(lat),
                    "health_max_ms": round(lat[-1] * 1e3, 1),
                    "health_p99_ms": round(lat[int(0.99 * (len(lat) - 1))] * 1e3, 1),
                    "health_median_ms": round(statistics.median(lat) * 1e3, 1)})
    return {"rounds": out, "worst_ms": max(r["health_max_ms"] for r in out)}


def memory_after_regexes(server: ServeProcess, rss_start: int, count: int = 50) -> dict:
    rng = random.Random(40)
    regexes = [repetition_regex(rng, over=i % 2 == 1) for i in range(count)]
    assert len(set(regexes)) == count
    peak = 0
    statuses = []
    with ThreadPoolExecutor(4) as pool:
        for status in pool.map(lambda rx: post(server.url, COMPLETIONS, {"prompt": "x", "max_tokens": 8,
                                                                          "guided_regex": rx}).status_code, regexes):
            statuses.append(status)
            peak = max(peak, server.rss())
    time.sleep(1.0)
    after = server.rss()
    return {"statuses": {s: statuses.count(s) for s in set(statuses)}, "rss_start_mb": round(rss_start / MB),
            "rss_peak_mb": round(max(peak, after) / MB), "rss_after_mb": round(after / MB),
            "rss_growth_mb": round((after - rss_start) / MB), "workers_rss_mb": round(server.children_rss() / MB)}


def hostile_classes(server: ServeProcess) -> dict:
    rng = random.Random(4040)
    cases: list[tuple[str, str, dict | bytes]] = []
    cases += [("past_limits", p, b) for p, b, _, _ in past_the_limits(rng, 40)]
    cases += [("malformed_tools", CHAT, b) for b, _ in malformed_tools(rng)]
    cases += [("deep_body", CHAT, deep_body(rng)) for _ in range(10)]
    for rx in (r"[^\s\S]", r"a[^\s\S]b", r"(?:[^\s\S])+x", r"[^\s\S]{3}"):
        cases.append(("unsatisfiable", COMPLETIONS, {"prompt": "x", "max_tokens": 4, "guided_regex": rx}))
    for extra in ({"top_p": 1e-300}, {"repetition_penalty": 1e-300}, {"temperature": 1e-300},
                  {"top_p": 5e-324, "repetition_penalty": 5e-324, "min_p": 1e-300}, {"presence_penalty": 1e-300}):
        cases.append(("numeric_edges", COMPLETIONS, {"prompt": "Once", "max_tokens": 8, "temperature": 1.0, **extra}))
    by_class: dict[str, dict[int, int]] = {}
    five = 0
    with HealthProbe(server.url, interval=0.02) as probe:
        for name, path, body in cases:
            status = post(server.url, path, body).status_code
            by_class.setdefault(name, {}).setdefault(status, 0)
            by_class[name][status] += 1
            five += status >= 500
    return {"cases": len(cases), "by_class": by_class, "5xx": five, "alive": server.alive,
            "health_failures": len(probe.failures), "health_max_ms": round(probe.worst() * 1e3, 1)}


def tool_runs(server: ServeProcess, model: str, runs: int) -> dict:
    out = {}
    variants = {"required": {"tool_choice": "required"},
                "required_one": {"tool_choice": "required", "parallel_tool_calls": False},
                "named_add": {"tool_choice": {"type": "function", "function": {"name": "add"}}},
                "named_note": {"tool_choice": {"type": "function", "function": {"name": "note"}}}}
    for name, extra in variants.items():
        parsed, reasons, calls = 0, {}, []
        for seed in range(runs):
            body = {"model": model, "messages": [{"role": "user", "content": "Add two and three, then note it."}],
                    "tools": [ADD, NOTE], "temperature": 1.0, "seed": seed, **extra}
            choice = post(server.url, CHAT, body).json()["choices"][0]
            reasons[choice["finish_reason"]] = reasons.get(choice["finish_reason"], 0) + 1
            tcs = choice["message"].get("tool_calls") or []
            calls.append(len(tcs))
            with contextlib.suppress(ValueError):
                parsed += bool(tcs) and all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in tcs)
        out[name] = {"parsed": f"{parsed}/{runs}", "finish_reasons": reasons, "calls_per_run": sorted(set(calls))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bard")
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    with ServeProcess(args.model) as server:
        rss_start = server.rss()
        report = {"model": args.model, "rss_start_mb": round(rss_start / MB)}
        report["health_while_20_schemas_compile"] = health_while_compiling(server)
        report["rss_after_50_regexes"] = memory_after_regexes(server, rss_start)
        report["hostile_classes"] = hostile_classes(server)
        report["tool_calls"] = tool_runs(server, args.model, args.runs)
        report["alive_at_end"] = server.alive
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
