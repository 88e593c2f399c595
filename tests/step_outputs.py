"""Watching one request's outputs step by step through an engine (shared by the decode-run and speculation tests)."""

from __future__ import annotations

from jaxserve import SamplingParams


def tokens_each_step(engine, request_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """Run `request_id` to its end alone; the tokens each step's output added to it (outputs are cumulative). A step
    gives the request one output at most, however many tokens it kept: AssertionError otherwise."""
    engine.add_request(request_id, prompt, params)
    seen, grew = 0, []
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.request_id == request_id]
        assert len(outs) <= 1, f"{len(outs)} outputs for {request_id} in one step"
        if outs:
            grew.append(len(outs[0].token_ids) - seen)
            seen = len(outs[0].token_ids)
    return grew
