"""The transfer endpoint (two in one process here): a block offered is pulled whole; an offer past its deadline is
not pulled (that pull would block), with a one-line error, and later pulls work."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.disagg.transfer import TransferEndpoint


@pytest.fixture(scope="module")
def pair():
    return TransferEndpoint(), TransferEndpoint()


def test_an_offered_block_is_pulled_whole(pair):
    prefill, decode = pair
    block = jnp.arange(2 * 3 * 16 * 4, dtype=jnp.float32).reshape(2, 3, 16, 4)
    uuid = prefill.offer(block, timeout_s=30)
    got = decode.pull(prefill.address, uuid, block.shape, "float32", timeout_s=30)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(block))


def test_an_offer_past_its_deadline_is_not_pulled_and_the_next_pull_works(pair):
    """Pulling a withdrawn offer would block until the peer closes (jax 0.10.2 on CPU), so none is started."""
    prefill, decode = pair
    block = jnp.ones((4, 8), jnp.float32)
    expired = prefill.offer(block, timeout_s=0.2)
    time.sleep(0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="expired before it could be pulled"):
        decode.pull(prefill.address, expired, block.shape, "float32", timeout_s=30, not_after=start - 0.1)
    assert time.monotonic() - start < 1
    fresh = prefill.offer(block * 2, timeout_s=30)
    np.testing.assert_array_equal(np.asarray(decode.pull(prefill.address, fresh, block.shape, "float32", 30)),
                                  np.full((4, 8), 2.0, np.float32))
