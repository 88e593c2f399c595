"""The start-up choice of the Pallas kernel's prefill tiles on a GPU: every candidate gives the default tiles'
attention (run in Pallas' interpreter on the CPU), the fastest fitting candidate is kept and cached per device
kind, and the split-KV backend runs its prefill items with it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.gpu.ragged_paged_attention import ragged_paged_attention
from jaxserve.kernels.gpu.split_kv_decode import SplitKvAttention
from jaxserve.platform import gpu_attention_choice
from jaxserve.platform.gpu_attention_choice import CANDIDATES, PrefillTiles, fitting, one_prefill


class Device:
    device_kind = "NVIDIA H200"


@pytest.mark.parametrize("tiles", CANDIDATES[1:], ids=lambda c: c.key)
def test_every_candidate_gives_the_default_tiles_attention(tiles):
    q, k, v, meta = one_prefill(96, num_heads=4, num_kv_heads=2, head_dim=16, page_size=16, dtype=jnp.float32)
    run = jax.jit(lambda c: ragged_paged_attention(q, k, v, meta, 0.25, block_q=c.block_q, kv_block=c.kv_block,
                                                   num_warps=c.num_warps, num_stages=c.num_stages,
                                                   interpret=True), static_argnums=0)
    np.testing.assert_allclose(np.asarray(run(tiles)), np.asarray(run(CANDIDATES[0])), atol=2e-5)


def test_a_program_holds_at_most_256_query_rows():
    # groups of 8 heads: 64 query tokens make 512 rows, past the registers; a one-page key block is still whole
    kept = fitting(CANDIDATES, num_tokens=2048, group=8, page_size=16)
    assert [c.block_q for c in kept] == [16, 32, 32, 32]
    assert fitting(CANDIDATES, num_tokens=2048, group=4, page_size=128) == [c for c in CANDIDATES
                                                                            if c.kv_block >= 128]


def test_the_fastest_tiles_are_kept_cached_and_run_by_the_prefill_items(tmp_path):
    calls = []

    def fake(fns, repeats=5):  # the fourth candidate is fastest
        calls.append(len(fns))
        return [1.0, 0.9, 0.8, 0.5, 0.7, 0.6][: len(fns)]

    shape = dict(num_tokens=2048, num_heads=32, num_kv_heads=8, head_dim=64, page_size=16, dtype=jnp.bfloat16)
    cache = tmp_path / "attention.json"
    chosen = gpu_attention_choice.choose(SplitKvAttention(), **shape, device=Device(), cache=cache, timer=fake)
    assert (chosen.block_q, chosen.prefill_kv_block, chosen.prefill_num_warps, chosen.prefill_num_stages) == (
        64, 64, 8, 3)
    assert (chosen.kv_block, chosen.num_warps, chosen.num_stages) == (64, 4, 2)  # the decode kernel's, unchanged
    again = gpu_attention_choice.choose(SplitKvAttention(), **shape, device=Device(), cache=cache, timer=fake)
    assert again == chosen and calls == [len(CANDIDATES)]  # the second start read the cache


def test_tiles_that_fail_to_compile_are_never_chosen():
    def ok():
        return jnp.zeros(1)

    def too_big():
        raise RuntimeError("out of shared memory")

    times = gpu_attention_choice.time_each([ok, too_big], repeats=2)
    assert times[0] < float("inf") == times[1]


def test_the_defaults_win_a_tie_and_nothing_changes_where_no_alternative_fits(tmp_path):
    shape = dict(num_heads=32, num_kv_heads=8, head_dim=64, page_size=16, dtype=jnp.bfloat16)
    tie = gpu_attention_choice.choose(SplitKvAttention(), num_tokens=1024, **shape, device=Device(),
                                      cache=tmp_path / "a.json", timer=lambda fns: [1.0] * len(fns))
    assert tie == dataclasses.replace(SplitKvAttention(), prefill_num_warps=4, prefill_num_stages=2)
    only = [PrefillTiles(16, 64, 4, 2), PrefillTiles(64, 64, 8, 3)]  # 64 x 8 rows: too many for groups of 8
    kept = gpu_attention_choice.choose(SplitKvAttention(), num_tokens=1024, num_heads=64, num_kv_heads=8,
                                       head_dim=64, page_size=16, dtype=jnp.bfloat16, device=Device(),
                                       cache=tmp_path / "b.json", timer=lambda fns: 1 / 0, candidates=only)
    assert kept == SplitKvAttention()


def test_split_kv_prefill_items_run_their_own_tiles():
    q, k, v, meta = one_prefill(48, num_heads=4, num_kv_heads=2, head_dim=16, page_size=16, dtype=jnp.float32)
    default = SplitKvAttention(interpret=True)
    tuned = dataclasses.replace(default, block_q=32, prefill_kv_block=32, prefill_num_warps=8, prefill_num_stages=3)
    np.testing.assert_allclose(np.asarray(tuned(q, k, v, meta, 0.25)), np.asarray(default(q, k, v, meta, 0.25)),
                               atol=2e-5)
