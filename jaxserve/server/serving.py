"""OpenAI completions and chat completions on top of the engine: prompts in, choices and SSE chunks out.

One HTTP request becomes one engine request per (prompt, choice) pair, `{id}-{k}`; with a seed, choice i
uses seed + i so choices are reproducible and distinct. The engine's outputs are cumulative; this module turns
them into deltas for streaming and into choices and usage for whole responses. Leaving `_merge` early (client
gone, task cancelled) aborts every engine request it started.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.validation import PromptError, encode_prompt, resolve_max_tokens
from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TopLogprob,
    UnsupportedValue,
    Usage,
)


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class _Sub:
    """One engine request: choice `index` of prompt `prompt_idx`."""

    index: int
    prompt_idx: int
    engine_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # streaming state
    text_len: int = 0
    num_tokens: int = 0
    last: RequestOutput | None = None
    text_offset: int = 0
    logprob_entries: list[Any] = field(default_factory=list)


class Generator:
    """Runs OpenAI requests against one engine."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.spec.vocab_size
        self.inflight: set[str] = set()

    # ---- prompts ----

    def _token_ids(self, prompt: str | list[int], param: str, add_special_tokens: bool) -> list[int]:
        try:
            return encode_prompt(prompt, self.tokenizer, self.vocab_size, add_special_tokens)
        except PromptError as e:
            raise APIError(400, str(e), param, e.code) from None

    def _max_tokens(self, num_prompt: int, requested: int | None, param: str) -> int:
        try:
            return resolve_max_tokens(num_prompt, requested, self.max_model_len)
        except PromptError as e:
            raise APIError(400, str(e), param, e.code) from None

    def _subs(self, req_id: str, prompts: list[list[int]], req: CompletionRequest | ChatCompletionRequest,
              default_max: int | None, logprobs: int | None, param: str) -> list[_Sub]:
        subs = []
        for p, ids in enumerate(prompts):
            max_tokens = self._max_tokens(len(ids), req.max_tokens or default_max, param)
            for i in range(req.n):
                seed = None if req.seed is None else req.seed + i
                try:
                    params = req.sampling_params(max_tokens, logprobs, seed)
                except ValueError as e:
                    raise APIError(400, str(e), str(e).split(" ")[0], "invalid_value") from None
                k = p * req.n + i
                subs.append(_Sub(k, p, f"{req_id}-{k}", ids, params))
        return subs

    def completion_subs(self, req_id: str, req: CompletionRequest) -> list[_Sub]:
        try:
            raw = req.prompts()
        except UnsupportedValue as e:
            raise APIError(400, str(e), e.param, e.code) from None
        prompts = [self._token_ids(p, "prompt", True) for p in raw]
        return self._subs(req_id, prompts, req, 16, req.logprobs, "prompt")

    def chat_subs(self, req_id: str, req: ChatCompletionRequest) -> list[_Sub]:
        if self.tokenizer is None:
            raise APIError(400, "This model has no tokenizer, so it cannot serve chat completions", "messages")
        text = self.tokenizer.apply_chat_template(req.chat_messages(), add_generation_prompt=True)
        ids = self._token_ids(text, "messages", False)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return self._subs(req_id, [ids], req, None, logprobs, "messages")

    # ---- running ----

    async def _merge(self, subs: list[_Sub]) -> AsyncIterator[tuple[_Sub, RequestOutput]]:
        """Interleave the engine streams of `subs`; on exit abort whatever is unfinished."""
        queue: asyncio.Queue[tuple[_Sub, RequestOutput | None, BaseException | None]] = asyncio.Queue()

        async def pump(sub: _Sub) -> None:
            try:
                async for out in self.engine.generate(sub.engine_id, sub.prompt_ids, sub.params):
                    queue.put_nowait((sub, out, None))
                queue.put_nowait((sub, None, None))
            except Exception as e:  # handed to the consumer
                queue.put_nowait((sub, None, e))

        self.inflight.update(s.engine_id for s in subs)
        tasks = [asyncio.create_task(pump(s)) for s in subs]
        try:
            remaining = len(tasks)
            while remaining:
                sub, out, err = await queue.get()
                if err is not None:
                    if isinstance(err, ValueError):
                        raise APIError(400, str(err), None, "invalid_value")
                    if isinstance(err, EngineDeadError):
                        raise APIError(503, str(err), type_="service_unavailable")
                    raise err
                if out is None:
                    remaining -= 1
                    continue
                if out.error:
                    raise APIError(500, f"The engine failed this request: {out.error}")
                yield sub, out
        finally:
            for t in tasks:
                t.cancel()
            for s in subs:
                self.engine.abort(s.engine_id)
                self.inflight.discard(s.engine_id)

    async def run(self, subs: list[_Sub]) -> None:
        """Run to completion; each sub's `last` holds its final output."""
        async with aclosing(self._merge(subs)) as merged:
            async for sub, out in merged:
                sub.last = out

    def abort_all(self) -> None:
        for rid in list(self.inflight):
            self.engine.abort(rid)

    # ---- formatting ----

    def _token_str(self, tid: int) -> str:
        return f"token_id:{tid}" if self.tokenizer is None else self.tokenizer.decode([tid], skip_special_tokens=False)

    def _completion_logprobs(self, sub: _Sub, out: RequestOutput, start: int) -> CompletionLogprobs | None:
        c = out.outputs[0]
        if sub.params.logprobs is None or c.logprobs is None:
            return None
        lp = CompletionLogprobs()
        for tid, d in zip(c.token_ids[start:], c.logprobs[start:], strict=False):
            tok = self._token_str(tid)
            lp.tokens.append(tok)
            lp.token_logprobs.append(d.get(tid))
            top = sorted(d.items(), key=lambda kv: -kv[1])[: sub.params.logprobs]
            lp.top_logprobs.append({self._token_str(t): v for t, v in top} if sub.params.logprobs else None)
            lp.text_offset.append(sub.text_offset)
            sub.text_offset += len(tok)
        return lp

    def _chat_logprobs(self, sub: _Sub, out: RequestOutput, start: int) -> ChatLogprobs | None:
        c = out.outputs[0]
        if sub.params.logprobs is None or c.logprobs is None:
            return None

        def entry(tid: int, value: float) -> TopLogprob:
            tok = self._token_str(tid)
            return TopLogprob(token=tok, logprob=value, bytes=list(tok.encode("utf-8")))

        content = []
        for tid, d in zip(c.token_ids[start:], c.logprobs[start:], strict=False):
            chosen = entry(tid, d.get(tid, float("-inf")))
            top = sorted(d.items(), key=lambda kv: -kv[1])[: sub.params.logprobs]
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[entry(t, v) for t, v in top]))
        return ChatLogprobs(content=content)

    @staticmethod
    def usage(subs: list[_Sub]) -> Usage:
        """Prompt tokens once per prompt (cached tokens from its first choice); completion tokens of all."""
        firsts = {s.prompt_idx: s for s in reversed(subs)}
        prompt = sum(len(s.prompt_ids) for s in firsts.values())
        cached = sum(s.last.num_cached_tokens if s.last else 0 for s in firsts.values())
        completion = sum(len(s.last.outputs[0].token_ids) if s.last else 0 for s in subs)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": cached})

    def completion_response(self, req_id: str, subs: list[_Sub]) -> CompletionResponse:
        choices = []
        for s in subs:
            c = s.last.outputs[0]  # type: ignore[union-attr]
            choices.append(CompletionChoice(index=s.index, text=c.text, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason,
                                            logprobs=self._completion_logprobs(s, s.last, 0)))  # type: ignore[arg-type]
        return CompletionResponse(id=req_id, model=self.model_name, choices=choices, usage=self.usage(subs))

    def chat_response(self, req_id: str, subs: list[_Sub]) -> ChatCompletionResponse:
        choices = []
        for s in subs:
            c = s.last.outputs[0]  # type: ignore[union-attr]
            choices.append(ChatChoice(index=s.index, message=ChatResponseMessage(content=c.text),
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                      logprobs=self._chat_logprobs(s, s.last, 0)))  # type: ignore[arg-type]
        return ChatCompletionResponse(id=req_id, model=self.model_name, choices=choices, usage=self.usage(subs))

    def _delta(self, s: _Sub, out: RequestOutput, chat: bool) -> dict[str, Any] | None:
        """The stream choice for what `out` adds to `s` since its last output, or None when nothing."""
        s.last = out
        c = out.outputs[0]
        delta, start = c.text[s.text_len:], s.num_tokens
        s.text_len, s.num_tokens = len(c.text), len(c.token_ids)
        if not delta and not c.finish_reason and (s.params.logprobs is None or start == s.num_tokens):
            return None
        if chat:
            lp: Any = self._chat_logprobs(s, out, start)
            choice = {"index": s.index, "delta": {"content": delta}}
        else:
            lp = self._completion_logprobs(s, out, start)
            choice = {"index": s.index, "text": delta}
        choice.update(logprobs=lp.model_dump() if lp else None, finish_reason=c.finish_reason)
        if c.finish_reason:
            choice["stop_reason"] = c.stop_reason
        return choice

    async def stream(self, req_id: str, subs: list[_Sub], chat: bool, include_usage: bool) -> AsyncIterator[str]:
        """SSE events: `data: {json}\\n\\n` chunks, then `data: [DONE]\\n\\n`."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], usage: Usage | None = None, with_usage: bool = False) -> str:
            chunk: dict[str, Any] = {"id": req_id, "object": obj, "created": created, "model": self.model_name,
                                     "choices": choices}
            if include_usage:
                chunk["usage"] = usage.model_dump() if usage else None
            return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"

        try:
            if chat:
                for s in subs:
                    yield event([{"index": s.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            async with aclosing(self._merge(subs)) as merged:
                async for s, out in merged:
                    choice = self._delta(s, out, chat)
                    if choice is not None:
                        yield event([choice])
            if include_usage:
                yield event([], self.usage(subs))
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:  # one request's internal failure ends its stream, not the server
            yield f"data: {json.dumps(APIError(500, f'Internal error: {e!r}').body())}\n\n"
        yield "data: [DONE]\n\n"


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
