"""The output side of the OpenAI endpoints: engine outputs into choices, logprobs, usage and stream deltas.

`ChoiceFormatter` is mixed into `serving.Generator`, which provides `tokenizer`, `token_text` and `model_name`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.server.responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TopLogprob,
    Usage,
)
from jaxserve.server.token_text import TokenText
from jaxserve.structured.tools import parse_tool_calls, streamable_prefix


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
    # chat with tools: how calls are parsed from the output (structured/tools.py)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "none"
    # completions' echo: the prompt's text leads the choice (and its tokens the logprobs); echoed once streamed
    echo: str | None = None
    echoed: bool = False
    drop_output: bool = False  # max_tokens 0: the one token the engine drew is left out
    prompt_logprobs: int | None = None  # vLLM's field, as asked for


class ChoiceFormatter:
    """Turns a request's subs (their engine outputs) into OpenAI's response bodies and stream choices."""

    tokenizer: Any
    token_text: TokenText
    model_name: str

    def _token_str(self, tid: int) -> str:
        return f"token_id:{tid}" if self.tokenizer is None else self.tokenizer.decode([tid], skip_special_tokens=False)

    def _completion_logprobs(self, sub: _Sub, out: RequestOutput, start: int,
                             echo: bool = False) -> CompletionLogprobs | None:
        """`tokens` are the decoded texts (offsets count them); top-logprobs keys are distinct per token. With
        `echo` the prompt's tokens come first, the first one's logprob None (vLLM's echo)."""
        c = out.outputs[0]
        if sub.params.logprobs is None or c.logprobs is None:
            return None
        lp = CompletionLogprobs()
        rows: list[tuple[int, dict[int, float] | None]] = []
        if echo:
            entries = getattr(out, "prompt_logprobs", None) or [None] * len(sub.prompt_ids)
            rows += list(zip(sub.prompt_ids, entries, strict=False))
        if not sub.drop_output:
            rows += list(zip(c.token_ids[start:], c.logprobs[start:], strict=False))
        k = sub.params.logprobs
        for tid, d in rows:
            tok = self._token_str(tid)
            lp.tokens.append(tok)
            lp.token_logprobs.append(None if d is None else d.get(tid))
            top = sorted((d or {}).items(), key=lambda kv: -kv[1])[:k]
            keys = self.token_text.keys([t for t, _ in top])
            lp.top_logprobs.append({key: v for key, (_, v) in zip(keys, top, strict=True)} if k and d else None)
            lp.text_offset.append(sub.text_offset)
            sub.text_offset += len(tok)
        return lp

    def _prompt_logprobs(self, sub: _Sub) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token (the first None) {id: {logprob, rank, decoded_token}} of
        the token itself and the top `prompt_logprobs` alternatives (rank None for a token outside them)."""
        if sub.prompt_logprobs is None or getattr(sub.last, "prompt_logprobs", None) is None:
            return None
        out: list[dict[str, Any] | None] = []
        for tid, d in zip(sub.prompt_ids, sub.last.prompt_logprobs, strict=False):
            if d is None:
                out.append(None)
                continue
            ranked = sorted(d.items(), key=lambda kv: -kv[1])[: sub.prompt_logprobs]
            ranks = {t: r for r, (t, _) in enumerate(ranked, 1)}
            keep = dict(ranked) | ({tid: d[tid]} if tid in d else {})
            out.append({str(t): {"logprob": v, "rank": ranks.get(t), "decoded_token": self._token_str(t)}
                        for t, v in keep.items()})
        return out

    def _chat_logprobs(self, sub: _Sub, out: RequestOutput, start: int) -> ChatLogprobs | None:
        c = out.outputs[0]
        if sub.params.logprobs is None or c.logprobs is None:
            return None

        def entry(tid: int, value: float) -> TopLogprob:
            tok, raw = self.token_text.text_and_bytes(tid)  # a byte token is `bytes:\\xNN`, its bytes exact
            return TopLogprob(token=tok, logprob=value, bytes=raw)

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
        completion = sum(len(s.last.outputs[0].token_ids) if s.last and not s.drop_output else 0 for s in subs)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": cached})

    def completion_response(self, req_id: str, subs: list[_Sub]) -> CompletionResponse:
        choices = []
        for s in subs:
            c = s.last.outputs[0]  # type: ignore[union-attr]
            text = (s.echo or "") + ("" if s.drop_output else c.text)
            lp = self._completion_logprobs(s, s.last, 0, echo=s.echo is not None)  # type: ignore[arg-type]
            choices.append(CompletionChoice(index=s.index, text=text, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason, logprobs=lp,
                                            prompt_logprobs=self._prompt_logprobs(s)))
        return CompletionResponse(id=req_id, model=self.model_name, choices=choices, usage=self.usage(subs))

    def chat_response(self, req_id: str, subs: list[_Sub]) -> ChatCompletionResponse:
        choices = []
        for s in subs:
            c = s.last.outputs[0]  # type: ignore[union-attr]
            content, calls = parse_tool_calls(c.text, s.tools, s.tool_choice)
            message = ChatResponseMessage(content=content, tool_calls=[t.to_openai() for t in calls] or None)
            choices.append(ChatChoice(index=s.index, message=message, finish_reason=_finish(c.finish_reason, calls),
                                      stop_reason=c.stop_reason,
                                      logprobs=self._chat_logprobs(s, s.last, 0)))  # type: ignore[arg-type]
        return ChatCompletionResponse(id=req_id, model=self.model_name, choices=choices, usage=self.usage(subs),
                                      prompt_logprobs=self._prompt_logprobs(subs[0]) if subs else None)

    def _delta(self, s: _Sub, out: RequestOutput, chat: bool) -> dict[str, Any] | None:
        """The stream choice for what `out` adds to `s` since its last output, or None when nothing. With tools,
        content is held back while it may be a call; the calls come whole in the choice's last chunk."""
        s.last = out
        c = out.outputs[0]
        # "abort" is no OpenAI finish_reason: an aborted choice ends without one, and the stream with an error event
        finish = None if c.finish_reason == "abort" else c.finish_reason
        calls: list = []
        shown = streamable_prefix(c.text, s.tools, s.tool_choice) if chat else "" if s.drop_output else c.text
        if chat and finish:
            content, calls = parse_tool_calls(c.text, s.tools, s.tool_choice)
            shown = c.text if not calls else shown + (content or "")[len(shown):]
        delta, start = shown[s.text_len:], s.num_tokens
        s.text_len, s.num_tokens = len(shown), len(c.token_ids)
        if not delta and not finish and (s.params.logprobs is None or start == s.num_tokens):
            return None
        if chat:
            lp: Any = self._chat_logprobs(s, out, start)
            choice = {"index": s.index, "delta": {"content": delta}}
            if calls:
                choice["delta"]["tool_calls"] = [t.to_openai(index=j) for j, t in enumerate(calls)]
                finish = _finish(finish, calls)
        else:
            first = s.echo is not None and not s.echoed
            lp = self._completion_logprobs(s, out, start, echo=first)
            choice = {"index": s.index, "text": (s.echo if first else "") + delta}
            s.echoed = s.echoed or first
        choice.update(logprobs=lp.model_dump() if lp else None, finish_reason=finish)
        if finish:
            choice["stop_reason"] = c.stop_reason
        return choice


def _finish(reason: str | None, calls: list) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when a finished choice holds calls."""
    return "tool_calls" if calls and reason == "stop" else reason
