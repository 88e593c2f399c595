"""Every stop rule of a request, and the visible output text.

Token-level stops (`check_token_stop`: EOS unless ignore_eos, stop_token_ids, max_tokens, max_model_len) and stop
strings (`StopChecker`), checked after every drawn token. The text comes from an
incremental `Detokenizer` (a few recent ids decoded per token, the same text as a full decode) and is held
back while it ends in an incomplete UTF-8 character or in a tail that could still grow into a stop string, so
the text only ever grows and streamed deltas are always whole characters. Stop strings are searched only in
the new text and the (longest stop - 1) characters before it: a check costs O(1) in the output length.
"""

from __future__ import annotations

from jaxserve.core.detokenizer import Detokenizer
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams


def check_token_stop(req: Request, max_model_len: int | None = None) -> RequestStatus | None:
    """Token-level stop check on the last generated token; sets req.stop_reason, returns the finish status.

    EOS (unless ignore_eos) and stop_token_ids give FINISHED_STOPPED; max_tokens or max_model_len give
    FINISHED_LENGTH; None means keep going. Stop strings need detokenized text and are the engine's job.
    """
    if not req.output_token_ids:
        return None
    last = req.output_token_ids[-1]
    params = req.sampling_params
    if not params.ignore_eos and req.eos_token_id is not None and last == req.eos_token_id:
        req.stop_reason = None
        return RequestStatus.FINISHED_STOPPED
    if last in params.stop_token_ids:
        req.stop_reason = last
        return RequestStatus.FINISHED_STOPPED
    if len(req.output_token_ids) >= req.max_tokens or (max_model_len is not None
                                                        and req.num_tokens >= max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None


class StopChecker:
    """Decides whether a request is done and keeps its output text (stop strings cut off)."""

    def __init__(self, params: SamplingParams, tokenizer, max_model_len: int) -> None:
        self.params = params
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.text = ""
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self._detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self._num_read = 0  # output ids given to the detokenizer
        self._held = ""  # decoded text past `text`: a tail that could still become a stop string

    def _show(self, piece: str) -> None:
        """Append to `text`. With no other reference to the old string CPython grows it in place, so a long
        output is not copied once per token (`self.text += piece` always copies: the attribute holds one)."""
        if piece:
            text, self.text = self.text, ""
            text += piece
            self.text = text

    def _new_text(self, ids: list[int], end: int, final: bool) -> str:
        """Text of ids[_num_read:end]; when `final`, also what the detokenizer holds back (an unfinished
        character). Its pieces never end in an incomplete character otherwise."""
        start, self._num_read = self._num_read, max(self._num_read, end)
        if self._detokenizer is None:
            return ""
        pieces = [self._detokenizer.push(ids[i]) for i in range(start, end)]
        if final:
            pieces.append(self._detokenizer.flush())
        return "".join(pieces)

    def check(self, req: Request) -> tuple[RequestStatus, str | int | None] | None:
        """Update the text with the request's newest token; return (status, stop_reason) when it must stop."""
        status = check_token_stop(req, self.max_model_len)
        ids = req.output_token_ids
        if status == RequestStatus.FINISHED_STOPPED:  # EOS or a stop token: its text is not shown
            self._show(self._held + self._new_text(ids, len(ids) - 1, final=True))
            self._held = ""
            return status, req.stop_reason
        at_length = status == RequestStatus.FINISHED_LENGTH
        p = self.params
        new = self._held + self._new_text(ids, len(ids), final=at_length)
        self._held = ""
        if p.stop and len(ids) >= p.min_tokens:  # vLLM: stop strings wait for min_tokens too
            keep = self._max_stop_len - 1
            shown = self.text[max(0, len(self.text) - keep) :]  # a stop string may begin in the shown tail
            window = shown + new
            hits = [(window.find(s), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                end = i + len(s) if p.include_stop_str_in_output else i
                self._show(new[: max(0, end - len(shown))])
                return RequestStatus.FINISHED_STOPPED, s
            # Hold back a tail that could still become a stop string, so streamed text never has to shrink.
            if not at_length:
                new, self._held = new[: max(0, len(new) - keep)], new[max(0, len(new) - keep) :]
        self._show(new)
        if at_length:
            return RequestStatus.FINISHED_LENGTH, None
        return None
