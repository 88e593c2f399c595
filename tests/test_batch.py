"""The ragged batch layout: the vectorized builder against a per-sequence reference of the documented format."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.batch import build_ragged_batch
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams


def reference_layout(scheduled: list[tuple[Request, int]], page_size: int) -> dict[str, np.ndarray]:
    """Token t of sequence s sits at cu_q_lens[s] + i, position kv_lens[s] - q_len[s] + i, slot page*size+off."""
    tokens, positions, slots, kv_lens, samples = [], [], [], [], []
    for req, n in scheduled:
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        for pos in range(start, end):
            tokens.append(req.all_token_ids[pos])
            positions.append(pos)
            slots.append(req.page_ids[pos // page_size] * page_size + pos % page_size)
        kv_lens.append(end)
        samples.append(end == req.num_tokens)
    width = max([1] + [len(r.page_ids) for r, _ in scheduled])
    table = [r.page_ids + [0] * (width - len(r.page_ids)) for r, _ in scheduled]
    cu = np.concatenate([[0], np.cumsum([n for _, n in scheduled])]).astype(np.int32)
    return dict(token_ids=tokens, positions=positions, slot_mapping=slots, kv_lens=kv_lens, samples=samples,
                page_table=np.array(table, dtype=np.int32).reshape(len(scheduled), width), cu_q_lens=cu,
                logits_indices=cu[1:] - 1)


@st.composite
def scheduled_requests(draw: st.DrawFn) -> tuple[list[tuple[Request, int]], int]:
    page_size = draw(st.sampled_from([1, 4, 16]))
    scheduled = []
    for i in range(draw(st.integers(0, 6))):
        prompt = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=60))
        req = Request(f"r{i}", prompt, SamplingParams(), arrival_time=0.0)
        req.output_token_ids = draw(st.lists(st.integers(0, 1000), max_size=20))
        req.num_computed_tokens = draw(st.integers(0, req.num_tokens - 1))
        n = draw(st.integers(1, req.num_tokens - req.num_computed_tokens))
        needed = -(-(req.num_computed_tokens + n) // page_size)
        req.page_ids = draw(st.lists(st.integers(1, 500), min_size=needed, max_size=needed + 2, unique=True))
        scheduled.append((req, n))
    return scheduled, page_size


@settings(max_examples=150, deadline=None)
@given(scheduled_requests())
def test_builder_matches_the_documented_layout(case: tuple[list[tuple[Request, int]], int]) -> None:
    scheduled, page_size = case
    batch = build_ragged_batch(scheduled, 0, page_size)
    for name, want in reference_layout(scheduled, page_size).items():
        got = getattr(batch, name)
        assert got.dtype == (bool if name == "samples" else np.int32), name
        np.testing.assert_array_equal(got, np.asarray(want, dtype=got.dtype).reshape(got.shape), err_msg=name)


def test_a_request_without_enough_pages_is_refused() -> None:
    req = Request("short", list(range(40)), SamplingParams(), arrival_time=0.0)
    req.page_ids = [1, 2]
    with pytest.raises(ValueError, match="request short holds 2 pages for 40 tokens"):
        build_ragged_batch([(req, 40)], 0, page_size=16)
