"""A prefill server, a decode server and a router, live on loopback: in this process (fast) or as processes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from server_helpers import LiveServer, free_port

from jaxserve.config.engine import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
# No warm-up: the tests compile only the buckets they use.
ENGINE_ARGS = dict(model="tiny", max_num_seqs=16, max_num_batched_tokens=128, chunk_size=64, page_size=16,
                   kv_cache_memory=8 * 2**20, max_model_len=1024, warmup=False)
ENGINE_FLAGS = ["--model", "tiny", "--max-num-seqs", "16", "--max-num-batched-tokens", "128", "--chunk-size", "64",
                "--block-size", "16", "--kv-cache-memory", "8MiB", "--max-model-len", "1024"]


@contextlib.contextmanager
def role_server(mode: str | None, chunked_transfer: bool = True, **overrides) -> Iterator[LiveServer]:
    """One server of `mode` (None, "prefill", "decode") built as `jaxserve serve` builds it, live in a thread."""
    from jaxserve.disagg.config import DisaggregationConfig
    from jaxserve.disagg.roles import role_app, role_engine

    role = DisaggregationConfig(mode=mode, kv_transfer_timeout=30.0, chunked_transfer=chunked_transfer)
    engine = role_engine(role, EngineConfig(**{**ENGINE_ARGS, **overrides}), "127.0.0.1")
    engine.start()
    try:
        with LiveServer(role_app(engine)) as live:
            live.engine = engine
            yield live
    finally:
        engine.shutdown()


@contextlib.contextmanager
def router_server(**flags) -> Iterator[LiveServer]:
    from jaxserve.router.app import RouterConfig, build_router_app

    with LiveServer(build_router_app(RouterConfig(**flags))) as live:
        yield live


def launch(*args: str, devices: int = 1) -> subprocess.Popen:
    """`jaxserve ARGS...` as a process importing this tree, on `devices` CPU devices; its output goes to a file
    (`proc.log_path`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    if devices > 1:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    path = Path(f"/tmp/jaxserve-disagg-test-{os.getpid()}-{free_port()}.log")
    with open(path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jaxserve", *args], stdout=log, stderr=log, env=env, cwd=ROOT)
    proc.log_path = path
    return proc


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited with {proc.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready in {timeout} s")


def complete(url: str, prompt: str, **body) -> list[str]:
    """The completion's tokens (as logprobs name them), through the whole-response API."""
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "logprobs": 0, "ignore_eos": True, **body},
                   timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def stream(url: str, prompt: str, **body) -> tuple[str, list[dict]]:
    """A streamed completion: its text, and every event (an error event included)."""
    events, text = [], ""
    payload = {"prompt": prompt, "stream": True, "ignore_eos": True, **body}
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                events.append(event)
                text += "".join(c.get("text", "") for c in event.get("choices", []))
    return text, events
