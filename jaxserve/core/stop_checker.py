"""Per-request stop conditions and the visible output text.

Token-level stops come from the scheduler's `check_token_stop` (EOS unless ignore_eos, stop_token_ids,
max_tokens, max_model_len); this adds stop strings, checked after every drawn token. The text is re-decoded
from the output ids and held back while it ends in an incomplete UTF-8 character or in a tail that could
still grow into a stop string, so the text only ever grows and streamed deltas are always whole characters.
"""

from __future__ import annotations

from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import check_token_stop

REPLACEMENT_CHAR = "\ufffd"


class StopChecker:
    """Decides whether a request is done and keeps its output text (stop strings cut off)."""

    def __init__(self, params: SamplingParams, tokenizer, max_model_len: int) -> None:
        self.params = params
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.text = ""
        self._max_stop_len = max((len(s) for s in params.stop), default=0)

    def _decode(self, ids: list[int], final: bool) -> str:
        if self.tokenizer is None or not ids:
            return ""
        text = self.tokenizer.decode(ids)
        if not final:
            text = text.rstrip(REPLACEMENT_CHAR)  # an incomplete multi-byte character: wait for its rest
        return text

    def check(self, req: Request) -> tuple[RequestStatus, str | int | None] | None:
        """Update the text with the request's newest token; return (status, stop_reason) when it must stop."""
        status = check_token_stop(req, self.max_model_len)
        if status == RequestStatus.FINISHED_STOPPED:  # EOS or a stop token: its text is not shown
            self.text = self._decode(req.output_token_ids[:-1], final=True)
            return status, req.stop_reason
        at_length = status == RequestStatus.FINISHED_LENGTH
        p = self.params
        previous = len(self.text)
        text = self._decode(req.output_token_ids, final=at_length)
        if p.stop:
            start = max(0, previous - self._max_stop_len + 1)
            hits = [(text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                self.text = text[: i + len(s)] if p.include_stop_str_in_output else text[:i]
                return RequestStatus.FINISHED_STOPPED, s
            # Hold back a tail that could still become a stop string, so streamed text never has to shrink.
            if not at_length:
                text = text[: max(previous, len(text) - self._max_stop_len + 1)]
        self.text = text
        if at_length:
            return RequestStatus.FINISHED_LENGTH, None
        return None
