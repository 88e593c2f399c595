"""TTFT of long prompts: prefill alone vs prefill + KV transfer (a prefill and a decode server, each pinned to its
own core), and the router's added TTFT. Prints medians; the figures go in docs/disaggregation.md.

    python scripts/bench_disagg.py --model small --prompt-tokens 2048 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def launch(core: int | None, *args: str, log: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    pin = ["taskset", "-c", str(core)] if core is not None else []
    with open(log, "w") as f:
        return subprocess.Popen([*pin, sys.executable, "-m", "jaxserve", *args], stdout=f, stderr=f, env=env)


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


def ttft(url: str, prompt: list[int], headers: dict[str, str] | None = None) -> float:
    """Seconds from sending a streamed completion (1 token) to its first event."""
    start = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers or {}, timeout=600) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                took = time.perf_counter() - start
                assert "error" not in line, line
                break
        for _ in lines:
            pass
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--short-repeats", type=int, default=40)
    a = ap.parse_args()
    flags = ["--model", a.model, "--max-model-len", str(a.prompt_tokens + 256), "--max-num-seqs", "8",
             "--max-num-batched-tokens", "512"]
    ports = {"p": 18101, "d": 18102, "r": 18103}
    url = {k: f"http://127.0.0.1:{v}" for k, v in ports.items()}
    procs = [launch(0, "serve", *flags, "--port", str(ports["p"]), "--disaggregation-mode", "prefill",
                    log="/tmp/bench-disagg-p.log"),
             launch(1, "serve", *flags, "--port", str(ports["d"]), "--disaggregation-mode", "decode",
                    log="/tmp/bench-disagg-d.log"),
             launch(1, "router", "--pd-disaggregation", "--prefill", url["p"], "--decode", url["d"], "--port",
                    str(ports["r"]), log="/tmp/bench-disagg-r.log")]
    try:
        for k in ("p", "d", "r"):
            wait(url[k])
        rng = random.Random(0)
        hdr = {"X-Jaxserve-Prefill": url["p"]}

        def prompt(n: int) -> list[int]:  # fresh ids each time: no prefix-cache hit
            return [rng.randrange(300, 30000) for _ in range(n)]

        for _ in range(2):  # first requests compile what warm-up left
            ttft(url["p"], prompt(a.prompt_tokens))
            ttft(url["d"], prompt(a.prompt_tokens), hdr)
            ttft(url["r"], prompt(16))
        alone, moved = [], []
        for _ in range(a.repeats):  # A/B alternating
            alone.append(ttft(url["p"], prompt(a.prompt_tokens)))
            moved.append(ttft(url["d"], prompt(a.prompt_tokens), hdr))
        counters = httpx.get(url["d"] + "/disagg/info").json()["counters"]
        direct, routed = [], []
        for _ in range(a.short_repeats):
            direct.append(ttft(url["d"], prompt(16), hdr))
            routed.append(ttft(url["r"], prompt(16)))
        med = statistics.median
        print(f"{a.prompt_tokens}-token prompt TTFT, median of {a.repeats}: prefill alone {med(alone) * 1e3:.1f} ms, "
              f"prefill + KV transfer {med(moved) * 1e3:.1f} ms ({(med(moved) / med(alone) - 1) * 100:+.1f}%)")
        pulls = counters["kv_pulls"]
        print(f"decode side: {pulls} pulls, {counters['kv_pull_bytes'] / pulls / 2**20:.2f} MiB each, "
              f"pull {counters['kv_pull_seconds'] / pulls * 1e3:.1f} ms, "
              f"insert {counters['kv_insert_seconds'] / max(counters['kv_imports'], 1) * 1e3:.1f} ms (mean)")
        print(f"16-token prompt TTFT, median of {a.short_repeats}: decode server direct {med(direct) * 1e3:.2f} ms, "
              f"through the router {med(routed) * 1e3:.2f} ms ({(med(routed) - med(direct)) * 1e3:+.2f} ms)")
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    main()
