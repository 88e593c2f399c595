"""Load against any OpenAI-compatible server: streaming /v1/completions, TTFT and ITL measured client-side.

Prompts go as token ids (vLLM, SGLang and jaxserve accept them), greedy with `ignore_eos` (a vLLM extension
the others share) so outputs have the asked length; the final usage chunk gives the token counts and, where
the server reports it, the cached prompt tokens. `logprobs: 0` makes servers send a chunk for every token even
when its text is empty (random ids through a byte tokenizer often are); a chunk counts as a token arrival when
it has text or logprob tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence

import httpx

from jaxserve.measure.bench.datasets import SampleRequest
from jaxserve.measure.bench.load import LoadConfig, RunResult, arrival_offsets
from jaxserve.measure.bench.results import RequestRecord


def _sampling_fields(load: LoadConfig) -> dict:
    """temperature always; top_p, top_k and min_p only when not at LoadConfig's (off) defaults: top_k and min_p
    are vLLM's extensions, which a strict OpenAI server may refuse."""
    defaults = {f.name: f.default for f in dataclasses.fields(LoadConfig)}
    out: dict = {"temperature": load.temperature}
    out.update({name: getattr(load, name) for name in ("top_p", "top_k", "min_p")
                if getattr(load, name) != defaults[name]})
    return out


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What a server's /v1/models says of its (first) model."""

    id: str
    root: str | None
    max_model_len: int | None


def served_model(base_url: str, timeout_s: float = 30.0, transport=None) -> ServedModel:
    """The first model of `base_url`'s /v1/models; ValueError, saying so, when the server cannot tell."""
    base = base_url.rstrip("/")
    try:
        with httpx.Client(timeout=timeout_s, transport=transport) as client:
            resp = client.get(base + "/v1/models")
            resp.raise_for_status()
            card = resp.json()["data"][0]
            length = card.get("max_model_len")
            return ServedModel(str(card["id"]), card.get("root"), int(length) if length is not None else None)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise ValueError(f"cannot learn the served model from {base}/v1/models ({e or type(e).__name__}); "
                         f"is the server up? (--served-model-name with --input-len and --output-len skips this)"
                         ) from None


async def _one(client, url: str, model: str, req: SampleRequest, arrival: float, start: float,
               progress: list[int], i: int, sampling: dict) -> RequestRecord:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, **sampling,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}, "logprobs": 0}
    rec = RequestRecord(prompt_len=req.prompt_len, arrival=arrival - start, role=req.role)
    times: list[float] = []
    usage = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(c.get("text") or (c.get("logprobs") or {}).get("tokens") for c in chunk.get("choices", [])):
                    times.append(time.perf_counter())
                    progress[i] = len(times)
    except Exception as e:  # network errors become failed requests, as in vLLM
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    if not times:
        rec.error = "no tokens received"
        return rec
    rec.success = True
    rec.ttft = times[0] - arrival
    rec.itl = [b - a for a, b in zip(times, times[1:], strict=False)]
    rec.latency = times[-1] - arrival
    rec.output_len = int(usage["completion_tokens"]) if usage else len(times)
    details = (usage or {}).get("prompt_tokens_details") or {}
    rec.cached_tokens = details.get("cached_tokens")
    return rec


async def _run(base_url: str, model: str | None, requests: Sequence[SampleRequest], load: LoadConfig,
               timeout_s: float, transport=None, on_done: Callable[[int], None] | None = None) -> RunResult:
    base = base_url.rstrip("/")
    url = base + "/v1/completions"
    offsets = arrival_offsets(len(requests), load.request_rate, load.burstiness, load.seed)
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    done_events = [asyncio.Event() for _ in requests]
    progress = [0] * len(requests)
    sampling = _sampling_fields(load)
    records: list[RequestRecord | None] = [None] * len(requests)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, transport=transport) as client:
        if model is None:
            try:
                resp = await client.get(base + "/v1/models")
                resp.raise_for_status()
                model = resp.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                raise ValueError(f"cannot learn the served model from {base}/v1/models ({e or type(e).__name__}); "
                                 f"is the server up? --served-model-name skips this") from None
        start = time.perf_counter()

        async def send(i: int) -> None:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            dep = requests[i].wait_for
            wait_tokens = requests[i].wait_tokens
            if dep is not None and wait_tokens is None:
                await done_events[dep].wait()
            elif dep is not None:  # poll the streamed token count of the dependency
                while progress[dep] < wait_tokens and not done_events[dep].is_set():
                    await asyncio.sleep(0.002)
            if sem is not None:
                await sem.acquire()
            try:
                records[i] = await _one(client, url, model, requests[i], time.perf_counter(), start, progress, i,
                                        sampling)
            finally:
                if sem is not None:
                    sem.release()
                done_events[i].set()
                if on_done is not None:
                    on_done(sum(e.is_set() for e in done_events))

        await asyncio.gather(*(send(i) for i in range(len(requests))))
        duration = time.perf_counter() - start
    recs = [r for r in records if r is not None]
    return RunResult(records=recs, duration=duration)


def run_http(base_url: str, requests: Sequence[SampleRequest], load: LoadConfig, *, model: str | None = None,
             timeout_s: float = 6 * 3600, transport=None, on_done: Callable[[int], None] | None = None) -> RunResult:
    """Send `requests` to `base_url` as `load` says; returns per-request records (client-side timing).

    `transport` (an httpx async transport) replaces the network, for tests; `on_done(n)` is called as each request
    ends, with how many have.
    """
    if math.isinf(load.request_rate) and load.max_concurrency is None and len(requests) > 1024:
        load = LoadConfig(load.request_rate, load.burstiness, 1024, load.seed)
    return asyncio.run(_run(base_url, model, requests, load, timeout_s, transport, on_done))
