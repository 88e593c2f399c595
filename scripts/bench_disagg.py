"""Disaggregated serving's costs on this machine. The figures go in docs/disaggregation.md.

    python scripts/bench_disagg.py transfer --model small --prompt-tokens 2048 --repeats 7
        TTFT of long prompts (fresh ids: no prefix-cache hit) with the prefill server alone, and through a decode
        server pulling chunk by chunk or whole (prefill server on core 0, decode servers on core 1), A/B/C
        alternating; medians, and the decode side's pull and insert times.
    python scripts/bench_disagg.py router --streams 256
        The router's added TTFT against an instant fake server (its own cost, nothing else), then `--streams`
        streams at once through it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
FAKE = '''
import asyncio, json, sys, uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
app = FastAPI()
@app.get("/health")
async def health():
    return {}
@app.post("/v1/completions")
async def completions(body: dict):
    async def events():
        for _ in range(body.get("max_tokens", 1)):
            yield "data: " + json.dumps({"choices": [{"text": "x"}]}) + "\\n\\n"
            await asyncio.sleep(body.get("delay", 0))
        yield "data: [DONE]\\n\\n"
    return StreamingResponse(events(), media_type="text/event-stream")
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


def launch(core: int | None, *args: str, log: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    pin = ["taskset", "-c", str(core)] if core is not None else []
    with open(log, "w") as f:
        return subprocess.Popen([*pin, sys.executable, *args], stdout=f, stderr=f, env=env)


def wait(url: str, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def ttft(client: httpx.Client, url: str, prompt, headers: dict[str, str] | None = None, **body) -> float:
    """Seconds from sending a streamed completion to its first event (the rest is read and dropped)."""
    start = time.perf_counter()
    payload = {"prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0, **body}
    with client.stream("POST", f"{url}/v1/completions", json=payload, headers=headers or {}, timeout=600) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                took = time.perf_counter() - start
                assert "error" not in line, line
                break
        for _ in lines:
            pass
    return took


def transfer(a: argparse.Namespace) -> None:
    flags = ["-m", "jaxserve", "serve", "--model", a.model, "--max-model-len", str(a.prompt_tokens + 256),
             "--max-num-seqs", "8", "--max-num-batched-tokens", "512"]
    url = {k: f"http://127.0.0.1:{p}" for k, p in (("p", 18101), ("d", 18102), ("w", 18104))}
    # each server compiles into a folder of its own, as the report's do: where jax's cache class is not the one the
    # engine makes write whole entries, another server starting beside it could read one half-written
    def cache(k: str) -> list[str]:
        return ["--compilation-cache-dir", os.path.expanduser(f"~/.cache/jaxserve/xla/bench-disagg-{k}")]

    procs = [launch(0, *flags, *cache("p"), "--port", "18101", "--disaggregation-mode", "prefill",
                    log="/tmp/bench-disagg-p.log"),
             launch(1, *flags, *cache("d"), "--port", "18102", "--disaggregation-mode", "decode",
                    log="/tmp/bench-disagg-d.log"),
             launch(1, *flags, *cache("w"), "--port", "18104", "--disaggregation-mode", "decode",
                    "--no-disaggregation-chunked-transfer", log="/tmp/bench-disagg-w.log")]
    try:
        for u in url.values():
            wait(u)
        rng, client, hdr = random.Random(0), httpx.Client(), {"X-Jaxserve-Prefill": url["p"]}

        def prompt() -> list[int]:
            return [rng.randrange(300, 30000) for _ in range(a.prompt_tokens)]

        for _ in range(2):  # first requests compile what warm-up left
            for k in url:
                ttft(client, url[k], prompt(), hdr)
        before = {k: httpx.get(url[k] + "/disagg/info").json()["counters"] for k in url}
        times = {k: [] for k in url}
        bootstrap = []  # the prefill server's bootstrap route alone: the prefill and one block offered, no pull
        for _ in range(a.repeats):
            for k in url:
                times[k].append(ttft(client, url[k], prompt(), hdr))
            start = time.perf_counter()
            r = client.post(url["p"] + "/disagg/prefill", json={"prompt_token_ids": prompt(), "params": {}},
                            timeout=600)
            assert r.status_code == 200, r.text
            bootstrap.append(time.perf_counter() - start)
        pc = httpx.get(url["p"] + "/disagg/info").json()["counters"]
        mean = (pc["prefill_seconds"] - before["p"]["prefill_seconds"]) / (pc["prefills"] - before["p"]["prefills"])
        print(f"prefill server: /disagg/prefill answered in {statistics.median(bootstrap) * 1e3:.0f} ms (median, "
              f"no pull); its engine's mean prefill there {mean * 1e3:.0f} ms")
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{a.prompt_tokens}-token prompt TTFT, median of {a.repeats} (A/B/C alternating): prefill alone "
              f"{med['p'] * 1e3:.0f} ms; + KV transfer chunk by chunk {med['d'] * 1e3:.0f} ms "
              f"({(med['d'] / med['p'] - 1) * 100:+.1f}%); + KV transfer whole {med['w'] * 1e3:.0f} ms "
              f"({(med['w'] / med['p'] - 1) * 100:+.1f}%)")
        for k, name in (("d", "chunk by chunk"), ("w", "whole")):
            c = httpx.get(url[k] + "/disagg/info").json()["counters"]
            d = {n: c[n] - before[k][n] for n in c}
            per = {n: v / a.repeats for n, v in d.items()}
            print(f"  {name}: {per['kv_pulls']:.1f} pulls/request, {per['kv_pull_bytes'] / 2**20:.1f} MiB/request, "
                  f"pulling {per['kv_pull_seconds'] * 1e3:.0f} ms/request, waited for pulls "
                  f"after the prefill answered {d['kv_wait_seconds'] / a.repeats * 1e3:.0f} ms, insert "
                  f"{d['kv_insert_seconds'] / a.repeats * 1e3:.0f} ms, prefill answer "
                  f"{d['prefill_answer_seconds'] / a.repeats * 1e3:.0f} ms")
    finally:
        for p in procs:
            p.kill()


def router(a: argparse.Namespace) -> None:
    fake, rt = "http://127.0.0.1:18111", "http://127.0.0.1:18112"
    procs = [launch(0, "-c", FAKE, "18111", log="/tmp/bench-router-fake.log"),
             launch(1, "-m", "jaxserve", "router", "--worker-urls", fake, "--port", "18112",
                    log="/tmp/bench-router.log")]
    try:
        wait(fake)
        wait(rt)
        client = httpx.Client()
        for _ in range(20):
            ttft(client, fake, "x")
            ttft(client, rt, "x")
        direct, routed = [], []
        for _ in range(a.repeats):
            direct.append(ttft(client, fake, "x"))
            routed.append(ttft(client, rt, "x"))
        md, mr = statistics.median(direct), statistics.median(routed)
        print(f"router TTFT against an instant server, median of {a.repeats} alternating: direct {md * 1e3:.2f} ms, "
              f"through the router {mr * 1e3:.2f} ms ({(mr - md) * 1e3:+.2f} ms)")

        async def streams(url: str) -> list[tuple[float, int]]:
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None), timeout=120) as c:
                async def one() -> tuple[float, int]:
                    start, first, n = time.perf_counter(), None, 0
                    body = {"prompt": "x", "max_tokens": 50, "delay": 0.1, "stream": True}
                    async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                first = first or time.perf_counter() - start
                                n += 1 if "error" not in line else 0
                    return first, n
                return await asyncio.gather(*(one() for _ in range(a.streams)))

        for name, url in (("direct", fake), ("through the router", rt)):
            start = time.perf_counter()
            res = asyncio.run(streams(url))
            firsts = sorted(f for f, _ in res)
            print(f"{a.streams} streams at once {name} (50 events each, 0.1 s apart): "
                  f"{sum(n == 50 for _, n in res)}/{a.streams} complete in {time.perf_counter() - start:.1f} s, "
                  f"TTFT p50 {firsts[len(firsts) // 2] * 1e3:.1f} ms, "
                  f"p99 {firsts[int(len(firsts) * 0.99)] * 1e3:.1f} ms")
    finally:
        for p in procs:
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["transfer", "router"])
    ap.add_argument("--model", default="small")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--streams", type=int, default=256)
    a = ap.parse_args()
    (transfer if a.what == "transfer" else router)(a)


if __name__ == "__main__":
    main()
