"""A small stand-in for AsyncEngine (same contract), for server tests that inject failures.

Not a product: it generates bytes of the prompt cycled, or seeded pseudo-random bytes when temperature > 0.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from types import SimpleNamespace

from jaxserve.config.engine import EngineConfig
from jaxserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.core.sampling_params import SamplingParams


class ByteTokenizer:
    """Bytes are tokens 0-255; 256 is BOS, 257 EOS."""

    eos_token_id = 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([256] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    """AsyncEngine's interface over an asyncio loop; `healthy` and `fail_marker` inject failures."""

    def __init__(self, max_model_len: int = 256, step_s: float = 0.001) -> None:
        self.config = EngineConfig(model="tiny", warmup=False)
        self.tokenizer = ByteTokenizer()
        self.spec = SimpleNamespace(vocab_size=512)
        self.max_model_len = max_model_len
        self.step_s = step_s
        self.healthy = True
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self.observers: list = []
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0}

    @property
    def is_healthy(self) -> bool:
        return self.healthy

    def start(self) -> None:
        pass

    def shutdown(self, timeout: float = 3.0) -> None:
        self.healthy = False

    def add_observer(self, obs) -> None:
        self.observers.append(obs)

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def stats(self) -> dict[str, float]:
        return {"num_running": len(self.running), "num_waiting": 0, "kv_usage": len(self.running) / 64,
                "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0, **self.counters}

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       cache_salt: str | None = None, *,
                       prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        if prompt_token_ids is not None:
            ids = prompt_token_ids
        else:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError("This model's maximum context length is exceeded")
        loop = asyncio.get_running_loop()
        metrics = RequestMetrics(arrival_time=loop.time(), first_scheduled_time=loop.time())
        rng = random.Random(params.seed)
        source = [t for t in ids if t < 256] or [97]
        out = CompletionOutput(0, "", [], logprobs=[] if params.logprobs is not None else None)
        ro = RequestOutput(request_id, None, ids, [out], False, metrics)
        self.running.add(request_id)
        self.counters["prompt_tokens"] += len(ids)
        try:
            for i in range(max_tokens):
                await asyncio.sleep(self.step_s)
                if request_id in self.aborted:
                    out.finish_reason = "abort"
                    break
                if b"FAIL" in bytes(source):
                    ro.error = "injected failure"
                    out.finish_reason = "abort"
                    break
                tok = rng.randrange(97, 123) if params.temperature > 0 else source[i % len(source)]
                out.token_ids = out.token_ids + [tok]
                out.text = self.tokenizer.decode(out.token_ids)
                if out.logprobs is not None:
                    out.logprobs = out.logprobs + [{tok: -0.5, 98: -1.5}]
                metrics.token_times.append(loop.time())
                metrics.first_token_time = metrics.first_token_time or loop.time()
                self.counters["generation_tokens"] += 1
                hit = next((s for s in params.stop if s in out.text), None)
                if hit is not None:
                    out.text = out.text[: out.text.index(hit)]
                    out.finish_reason, out.stop_reason = "stop", hit
                    break
                if i == max_tokens - 1:
                    out.finish_reason = "length"
                    break
                yield ro
            metrics.finish_time = loop.time()
            ro.finished = True
            for obs in self.observers:
                obs.on_request_finished(ro)
            yield ro
        finally:
            self.running.discard(request_id)
