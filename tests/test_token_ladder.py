"""Token buckets: how much a step can be padded, and which bucket a step lands in."""

import pytest

from jaxserve.config.engine import EngineConfig
from jaxserve.runner.model_runner import bucket_for, default_token_ladder, half_octave_ladder, power_of_two_ladder


@pytest.mark.parametrize("limit", [1, 50, 128, 300, 512, 2048, 8192])
def test_default_ladder_bounds_padding(limit):
    ladder = default_token_ladder(limit)
    assert ladder[-1] == limit and list(ladder) == sorted(set(ladder))
    for n in range(1, limit + 1):
        b = bucket_for(n, ladder)
        assert b >= n
        if n > 256:
            assert b <= 1.125 * n + 1, (n, b)  # a prefill step above 256 tokens wastes at most a ninth
        elif n > 16:
            assert b <= 1.5 * n + 1, (n, b)


def test_ladders_for_a_2048_token_budget():
    assert default_token_ladder(2048) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 288, 320, 352, 384,
                                          416, 448, 480, 512, 576, 640, 704, 768, 832, 896, 960, 1024, 1152, 1280,
                                          1408, 1536, 1664, 1792, 1920, 2048)
    assert half_octave_ladder(100) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100)
    assert power_of_two_ladder(100) == (1, 2, 4, 8, 16, 32, 64, 100)


def test_bucket_for_rejects_a_step_past_the_ladder():
    assert bucket_for(300, default_token_ladder(512)) == 320
    assert bucket_for(260, default_token_ladder(512)) == 288
    with pytest.raises(ValueError, match="exceeds the largest bucket 512"):
        bucket_for(513, default_token_ladder(512))


def test_an_explicit_ladder_must_hold_a_whole_step() -> None:
    with pytest.raises(ValueError, match=r"largest token bucket \(272\) must hold a whole step"):
        EngineConfig(model="tiny", max_num_batched_tokens=320, token_buckets=(32, 128, 272))
    assert EngineConfig(model="tiny", max_num_batched_tokens=320, token_buckets=(32, 320)).token_buckets == (32, 320)
