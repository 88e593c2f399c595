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
import dataclasses
import json
import random
import statistics
import subprocess
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


# /health polled from a process of its own (a thread beside the 20 client threads would share their GIL and
# time its own waits), every 10 ms until its stdin closes; it prints the latencies.
_PROBE = r"""
import json, select, sys, time, httpx
lat = []
with httpx.Client(timeout=30) as client:
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0.01)[0]:
        t = time.perf_counter()
        client.get(sys.argv[1] + "/health").raise_for_status()
        lat.append(time.perf_counter() - t)
print(json.dumps(lat))
"""


def health_while_compiling(server: ServeProcess, rounds: int = 3, count: int = 20) -> dict:
    out = []
    for r in range(rounds):
        bodies = [{"prompt": "x", "max_tokens": 4, "guided_json": wide_schema(1000 * (r + 1) + i)}
                  for i in range(count)]
        probe = subprocess.Popen([sys.executable, "-c", _PROBE, server.url], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert probe.stdout is not None and probe.stdout.readline().strip() == "ready"
        with ThreadPoolExecutor(count) as pool:
            t = time.perf_counter()
            statuses = list(pool.map(lambda b: post(server.url, COMPLETIONS, b).status_code, bodies))
            wall = time.perf_counter() - t
        lat = sorted(json.loads(probe.communicate("")[0].splitlines()[-1]))
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


def isolation_cost(model: str, rounds: int = 20) -> dict:
    """Per-compile latency of the two designs, alternating on distinct grammars: a thread alone (compile on a
    64 MB stack here) against the worker process first and then that thread (what the server does)."""
    import asyncio

    from jaxserve.core.sampling_params import StructuredOutputsParams
    from jaxserve.core.tokenizer import load_tokenizer
    from jaxserve.structured.compile_worker import CompileWorker, on_big_stack
    from jaxserve.structured.compiler import GrammarCompiler
    from jaxserve.structured.grammar import compile_grammar, grammar_source, tokenizer_spec
    from jaxserve.structured.tools import tool_constraint

    tok = load_tokenizer(model)
    vocab = getattr(tok, "vocab_size", 512)  # a BPE model's (bard: 4096); the byte presets' 512

    def tools(i: int) -> list[dict]:
        return [ADD, {**NOTE, "function": {**NOTE["function"], "name": f"note{i}"}}]

    kinds = {"regex": lambda i: StructuredOutputsParams(regex=f"[a-z]{{{i + 1},{i + 9}}}-[0-9]{{4}}"),
             "tool_calls": lambda i: tool_constraint(tools(i), "required", 300),
             "schema_20kb": lambda i: StructuredOutputsParams(json=wide_schema(9000 + i))}

    async def run() -> dict:
        compiler = GrammarCompiler(tok, vocab)
        await compiler.compile(StructuredOutputsParams(regex="warm"))  # the workers' start is not a compile
        out = {}
        for name, make in kinds.items():
            thread, process = [], []
            for i in range(rounds):
                for design in ("thread", "process") if i % 2 else ("process", "thread"):
                    spec = make(2 * i + (design == "process"))
                    t = time.perf_counter()
                    if design == "thread":
                        src = await asyncio.to_thread(grammar_source, spec)
                        await asyncio.to_thread(on_big_stack, compile_grammar, tok, vocab, src)
                        thread.append(time.perf_counter() - t)
                    else:
                        await compiler.compile(spec)
                        process.append(time.perf_counter() - t)
            out[name] = {"thread_median_ms": round(statistics.median(thread) * 1e3, 2),
                         "process_then_thread_median_ms": round(statistics.median(process) * 1e3, 2)}
        out["workers_rss_mb"] = round(compiler.rss_bytes() / MB)
        compiler.close()
        fresh = CompileWorker(tokenizer_spec(tok, vocab), dataclasses.asdict(compiler.limits))
        t = time.perf_counter()
        await fresh.check(grammar_source(StructuredOutputsParams(regex="x")), 60)
        out["worker_start_ms"] = round((time.perf_counter() - t) * 1e3)
        fresh.kill()
        return out

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bard")
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    report: dict = {"model": args.model, "isolation_cost": isolation_cost(args.model)}
    with ServeProcess(args.model) as server:
        rss_start = server.rss()
        report["rss_start_mb"] = round(rss_start / MB)
        report["health_while_20_schemas_compile"] = health_while_compiling(server)
        report["rss_after_50_regexes"] = memory_after_regexes(server, rss_start)
        report["hostile_classes"] = hostile_classes(server)
        report["tool_calls"] = tool_runs(server, args.model, args.runs)
        report["alive_at_end"] = server.alive
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
