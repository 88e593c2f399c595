"""Shared fixtures: one small-bucket `tiny` engine for the whole session (JAX compiles dominate test time)."""

import pytest

TINY_ENGINE_ARGS = dict(max_num_seqs=16, max_num_batched_tokens=128, chunk_size=64, page_size=16,
                        kv_cache_memory=8 * 2**20, max_model_len=1024)


@pytest.fixture(scope="session")
def tiny_llm():
    from jaxserve import LLM

    return LLM(model="tiny", **TINY_ENGINE_ARGS)
