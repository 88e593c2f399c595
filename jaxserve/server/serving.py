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
from typing import Any

from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.tokenizer import TokenizerError
from jaxserve.core.validation import PromptError, encode_prompt, resolve_max_tokens
from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.server.choices import ChoiceFormatter, _Sub
from jaxserve.server.errors import APIError
from jaxserve.server.limits import ServerLimits
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedValue
from jaxserve.server.responses import Usage
from jaxserve.server.structured_fields import constraint_field, structured_outputs
from jaxserve.server.token_text import TokenText
from jaxserve.structured.compile_worker import WorkerUnavailable
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.grammar import GRAMMAR_FAILED
from jaxserve.structured.limits import GrammarError, GrammarLimitError
from jaxserve.structured.tools import template_messages

__all__ = ["APIError", "Generator", "new_request_id"]
logger = logging.getLogger("jaxserve.server")
# A text prompt longer than this many characters per token of context is first tokenized in part.
PROBE_CHARS_PER_TOKEN, PROBE_SLACK_TOKENS = 8, 64


class StreamBackedUp(Exception):
    """A stream's reader fell `stream_buffer_tokens` behind the engine."""


def _shutdown_error() -> APIError:
    return APIError(503, "The server is shutting down: the request was aborted before it finished", None,
                    "server_shutdown", type_="service_unavailable")


class Generator(ChoiceFormatter):
    """Runs OpenAI requests against one engine."""

    def __init__(self, engine: Any, model_name: str, limits: ServerLimits | None = None) -> None:
        self.engine = engine
        self.limits = limits or ServerLimits()
        self.closing = False  # set by abort_all at shutdown: new requests get 503
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.token_text = TokenText(engine.tokenizer)
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.spec.vocab_size
        self.inflight: set[str] = set()
        lim = self.limits
        self.grammars = GrammarCompiler(engine.tokenizer, self.vocab_size,
                                        cache_bytes=lim.structured_outputs_cache_bytes,
                                        timeout_s=lim.structured_outputs_compile_timeout)

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
            # max_tokens 0 (echo only): the engine draws one token, which the response leaves out
            max_tokens = self._max_tokens(len(ids), 1 if req.max_tokens == 0 else req.max_tokens or default_max, param)
            for i in range(req.n):
                seed = None if req.seed is None else req.seed + i
                try:
                    if i == 0:  # built once a prompt: a tool call's grammar is fitted to the budget (ms per tool)
                        constraint = structured_outputs(req, max_tokens)
                    params = req.sampling_params(max_tokens, logprobs, seed, constraint)
                except ValueError as e:
                    raise APIError(400, str(e), str(e).split(" ")[0], "invalid_value") from None
                k = p * req.n + i
                subs.append(_Sub(k, p, f"{req_id}-{k}", ids, params, prompt_logprobs=req.prompt_logprobs))
        if subs:
            self._check_processing(subs[0].params, req)
        return subs

    def _check_processing(self, params: SamplingParams, req: CompletionRequest | ChatCompletionRequest) -> None:
        """400 for a logit_bias outside the vocabulary (constraints are compiled by `compile_constraints`)."""
        bad = next((t for t in params.logit_bias or {} if t >= self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"logit_bias holds token id {bad}, outside the vocabulary (size {self.vocab_size})",
                           "logit_bias", "invalid_value")

    async def compile_constraints(self, subs: list[_Sub], req: CompletionRequest | ChatCompletionRequest) -> None:
        """Compile each distinct constraint of `subs` (structured/compiler.py: checked, compiled in a worker
        process first, off the event loop) and attach it to their params; a 400 naming the field when it does
        not compile or is past a limit."""
        done: list[tuple[object, object]] = []  # (spec, compiled spec): equal specs compile once
        for s in subs:
            spec = s.params.structured_outputs
            if spec is None:
                continue
            attached = next((c for d, c in done if d == spec), None)
            if attached is None:
                try:
                    attached = await self.grammars.attach(spec)
                except GrammarError as e:
                    code = "grammar_limit" if isinstance(e, GrammarLimitError) else "invalid_value"
                    raise APIError(400, f"The structured output constraint does not compile: {e}",
                                   constraint_field(req), code) from None
                except WorkerUnavailable as e:  # the server's own fault: a 503, logged
                    logger.error("%s", e)
                    raise APIError(503, f"Structured outputs are unavailable: {e}", None, "grammar_compiler",
                                   type_="service_unavailable") from None
                done.append((spec, attached))
            s.params.structured_outputs = attached  # type: ignore[assignment]

    def completion_subs(self, req_id: str, req: CompletionRequest) -> list[_Sub]:
        try:
            raw = req.prompts()
        except UnsupportedValue as e:
            raise APIError(400, str(e), e.param, e.code) from None
        prompts = [self._token_ids(p, "prompt", True) for p in raw]
        subs = self._subs(req_id, prompts, req, 16, req.logprobs, "prompt")
        for s in subs:
            if req.echo:  # the prompt leads the choice's text (and its logprobs)
                p = raw[s.prompt_idx]
                s.echo = p if isinstance(p, str) else self.tokenizer.decode(p) if self.tokenizer else ""
            s.drop_output = req.max_tokens == 0
        return subs

    def chat_subs(self, req_id: str, req: ChatCompletionRequest) -> list[_Sub]:
        if self.tokenizer is None:
            raise APIError(400, "This model has no tokenizer, so it cannot serve chat completions", "messages")
        messages = req.chat_messages(getattr(self.tokenizer, "chat_template", None))
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      **({"tools": req.tools} if req.tools else {}))
        except TokenizerError as e:  # e.g. the template refuses this order of roles
            raise APIError(400, str(e), "messages") from None
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        try:
            ids = self._token_ids(text, "messages", False)
            subs = self._subs(req_id, [ids], req, None, logprobs, "messages")
        except APIError as e:
            if req.tools and e.code == "context_length_exceeded":
                e.message += f" The {len(req.tools)} tools took {self._tools_tokens(req, messages)} of its tokens."
            raise
        for s in subs:
            s.tools, s.tool_choice = req.tools, req.effective_tool_choice
        return subs

    def _tools_tokens(self, req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> int:
        """Tokens the request's tools add to its prompt (with tools rendered, less without)."""
        template = getattr(self.tokenizer, "chat_template", None)
        bare = template_messages([m.template_dict() for m in req.messages], None, template)
        with_tools = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=req.tools)
        without = self.tokenizer.apply_chat_template(bare, add_generation_prompt=True)
        return len(self.tokenizer.encode(with_tools, add_special_tokens=False)) - len(
            self.tokenizer.encode(without, add_special_tokens=False))

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
                        if out.error and out.error.startswith(GRAMMAR_FAILED):  # a grammar limit, mid-output
                            raise APIError(400, out.error, None, "grammar_limit")
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
        """Shutdown: refuse new requests (503) and abort the ones in flight; end the grammar compilers."""
        self.closing = True
        for rid in list(self.inflight):
            self.engine.abort(rid)
        self.grammars.close()

    async def stream(self, req_id: str, subs: list[_Sub], chat: bool, include_usage: bool,
                     deadline: float | None = None, cut: asyncio.Event | None = None,
                     continuous_usage: bool = False) -> AsyncIterator[str]:
        """SSE events: `data: {json}\\n\\n` chunks, then `data: [DONE]\\n\\n`; a failure (or shutdown's abort) is an
        error event before [DONE]. `cut` is set when the reader falls too far behind (see `_merge`). With
        `include_usage` the last chunk holds the usage and the others `usage: null`; with `continuous_usage`
        (vLLM's `continuous_usage_stats`) every chunk holds the usage so far."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], usage: Usage | None = None) -> str:
            chunk: dict[str, Any] = {"id": req_id, "object": obj, "created": created, "model": self.model_name,
                                     "choices": choices}
            if include_usage:
                if usage is None and continuous_usage:
                    usage = self.usage(subs)
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
