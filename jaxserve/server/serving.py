"""OpenAI completions and chat completions on top of the engine: prompts in, choices and SSE chunks out.

One HTTP request becomes one engine request per (prompt, choice) pair, `{id}-{k}`; with a seed, choice i
uses seed + i so choices are reproducible and distinct. The engine's outputs are cumulative; this module turns
them into deltas for streaming and into choices and usage for whole responses. Leaving `_merge` early (client
gone, task cancelled, deadline passed, reader too far behind) aborts every engine request it started.

Back-pressure: only each engine request's newest (cumulative) output is held, so a slow reader costs one
output per choice, never a queue; and a stream whose reader falls `stream_buffer_tokens` behind the engine is
aborted (its pages freed) and its response cut.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.tokenizer import TokenizerError
from jaxserve.core.validation import PromptError, encode_prompt, resolve_max_tokens
from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.server.errors import APIError
from jaxserve.server.limits import ServerLimits
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

__all__ = ["APIError", "Generator", "new_request_id"]
logger = logging.getLogger("jaxserve.server")
# A text prompt longer than this many characters per token of context is first tokenized in part.
PROBE_CHARS_PER_TOKEN, PROBE_SLACK_TOKENS = 8, 64


class StreamBackedUp(Exception):
    """A stream's reader fell `stream_buffer_tokens` behind the engine."""


def _shutdown_error() -> APIError:
    return APIError(503, "The server is shutting down: the request was aborted before it finished", None,
                    "server_shutdown", type_="service_unavailable")


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

    def __init__(self, engine: Any, model_name: str, limits: ServerLimits | None = None) -> None:
        self.engine = engine
        self.limits = limits or ServerLimits()
        self.closing = False  # set by abort_all at shutdown: new requests get 503
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.spec.vocab_size
        self.inflight: set[str] = set()

    # ---- prompts ----

    def _too_long(self, what: str, param: str) -> APIError:
        return APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, the "
                             f"prompt has {what} tokens. Please reduce the length of the prompt.", param,
                        "context_length_exceeded")

    def _token_ids(self, prompt: str | list[int], param: str, add_special_tokens: bool) -> list[int]:
        """The prompt's ids (400 unless they fit the context). A prompt too long to fit is refused after a look
        at its start, not once all of it is tokenized: tokenizers are C code that holds the GIL."""
        if not isinstance(prompt, str) and len(prompt) > self.max_model_len:
            raise self._too_long(str(len(prompt)), param)
        probe = PROBE_CHARS_PER_TOKEN * (self.max_model_len + PROBE_SLACK_TOKENS)
        try:
            if isinstance(prompt, str) and len(prompt) > probe:
                head = encode_prompt(prompt[:probe], self.tokenizer, self.vocab_size, add_special_tokens)
                if len(head) > self.max_model_len + PROBE_SLACK_TOKENS:  # cutting moves the count by a few tokens
                    raise self._too_long(f"more than {len(head) - PROBE_SLACK_TOKENS}", param)
            return encode_prompt(prompt, self.tokenizer, self.vocab_size, add_special_tokens)
        except PromptError as e:
            raise APIError(400, str(e), param, e.code) from None
        except UnicodeError:  # JSON allows lone surrogates ("\ud800"), which no tokenizer can encode
            raise APIError(400, "The prompt is not valid Unicode (it holds a lone surrogate)", param,
                           "invalid_value") from None

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
        try:
            text = self.tokenizer.apply_chat_template(req.chat_messages(), add_generation_prompt=True)
        except TokenizerError as e:  # e.g. the template refuses this order of roles
            raise APIError(400, str(e), "messages") from None
        ids = self._token_ids(text, "messages", False)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return self._subs(req_id, [ids], req, None, logprobs, "messages")

    # ---- running ----

    async def _merge(self, subs: list[_Sub], deadline: float | None = None, buffer_tokens: int = 0,
                     cut: asyncio.Event | None = None) -> AsyncIterator[tuple[_Sub, RequestOutput]]:
        """Interleave the engine streams of `subs`, each sub's newest output only; on exit abort whatever is
        unfinished.

        Past `deadline` (event-loop time) raises a 504. With `buffer_tokens`, an engine output that many tokens
        ahead of its sub's `num_tokens` (what the reader has taken) aborts every sub at once and sets `cut`.
        """
        newest: dict[int, tuple[_Sub, RequestOutput]] = {}
        failures: list[BaseException] = []
        wake = asyncio.Event()
        ended = 0

        async def pump(sub: _Sub) -> None:
            nonlocal ended
            try:
                async for out in self.engine.generate(sub.engine_id, sub.prompt_ids, sub.params,
                                                      prompt_token_ids=sub.prompt_ids):
                    if buffer_tokens and len(out.outputs[0].token_ids) - sub.num_tokens > buffer_tokens:
                        raise StreamBackedUp(f"the client stopped reading: {buffer_tokens} tokens unsent")
                    newest[sub.index] = (sub, out)
                    wake.set()
            except StreamBackedUp as e:
                logger.warning("%s: %s; aborted (--stream-buffer-tokens)", sub.engine_id.rpartition("-")[0], e)
                failures.append(e)
                for s in subs:  # free the pages now: the reader may never come back to close the stream
                    self.engine.abort(s.engine_id)
                if cut is not None:
                    cut.set()
            except Exception as e:  # handed to the consumer
                failures.append(e)
            finally:
                ended += 1
                wake.set()

        self.inflight.update(s.engine_id for s in subs)
        tasks = [asyncio.create_task(pump(s)) for s in subs]
        try:
            while True:
                if failures:
                    raise self._failure(failures[0])
                if newest:
                    ready = list(newest.values())
                    newest.clear()
                    for sub, out in ready:
                        if out.error:
                            raise APIError(500, f"The engine failed this request: {out.error}")
                        yield sub, out
                    continue
                if ended == len(tasks):
                    return
                wake.clear()
                try:
                    async with asyncio.timeout_at(deadline):
                        await wake.wait()
                except TimeoutError:
                    raise APIError(504, f"The request did not finish within the server's request timeout "
                                        f"({self.limits.request_timeout} s)", None, "timeout") from None
        finally:
            for t in tasks:
                t.cancel()
            for s in subs:
                self.engine.abort(s.engine_id)
                self.inflight.discard(s.engine_id)

    @staticmethod
    def _failure(err: BaseException) -> BaseException:
        """The client-facing error for an engine stream's failure."""
        if isinstance(err, ValueError):
            return APIError(400, str(err), None, "invalid_value")
        if isinstance(err, EngineDeadError):
            return APIError(503, str(err), type_="service_unavailable")
        if isinstance(err, StreamBackedUp):
            return APIError(503, f"The stream was aborted: {err}", None, "stream_backed_up")
        return err

    async def run(self, subs: list[_Sub], deadline: float | None = None) -> None:
        """Run to completion; each sub's `last` holds its final output. Raises 503 for a request that shutdown
        aborted, so a cut response is never a success."""
        async with aclosing(self._merge(subs, deadline)) as merged:
            async for sub, out in merged:
                sub.last = out
        if any(s.last is None or s.last.outputs[0].finish_reason == "abort" for s in subs):
            raise _shutdown_error() if self.closing else APIError(500, "The engine aborted this request")

    def abort_all(self) -> None:
        """Shutdown: refuse new requests (503) and abort the ones in flight."""
        self.closing = True
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

    async def stream(self, req_id: str, subs: list[_Sub], chat: bool, include_usage: bool,
                     deadline: float | None = None, cut: asyncio.Event | None = None) -> AsyncIterator[str]:
        """SSE events: `data: {json}\\n\\n` chunks, then `data: [DONE]\\n\\n`; a failure (or shutdown's abort) is an
        error event before [DONE]. `cut` is set when the reader falls too far behind (see `_merge`)."""
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
            async with aclosing(self._merge(subs, deadline, self.limits.stream_buffer_tokens, cut)) as merged:
                async for s, out in merged:
                    choice = self._delta(s, out, chat)
                    if choice is not None:
                        yield event([choice])
            if self.closing and any(s.last is not None and s.last.outputs[0].finish_reason == "abort" for s in subs):
                raise _shutdown_error()
            if include_usage:
                yield event([], self.usage(subs))
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:  # one request's internal failure ends its stream, not the server
            yield f"data: {json.dumps(APIError(500, f'Internal error: {e!r}').body())}\n\n"
        yield "data: [DONE]\n\n"


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
