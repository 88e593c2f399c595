"""Prompt logprobs (`SamplingParams.prompt_logprobs`, vLLM's meaning) from the engine's prefill rows, checked
against HF transformers' log-softmax of the same checkpoint (the shipped `bard`), chunked and unchunked."""

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from jaxserve import LLM, SamplingParams
from jaxserve.measure.eval.windows import read_eval_text
from modelspec.spec import resolve_model_path

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=128, chunk_size=128, page_size=16,
              kv_cache_memory=4 * 2**20, token_buckets=(16, 32, 64, 128), warmup=False)


@pytest.fixture(scope="module")
def bard():
    return LLM("bard", **ENGINE)


@pytest.fixture(scope="module")
def hf():
    return LlamaForCausalLM.from_pretrained(resolve_model_path("bard"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(bard):
    ids = bard.tokenizer.encode(read_eval_text("bard", "held-out"), add_special_tokens=False)
    return [ids[:2], ids[100:137], ids[300:420]]  # 2, 37 and 120 tokens


def hf_logprobs(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1).numpy()


def check_against_hf(hf, ids: list[int], plp, k: int) -> None:
    ref = hf_logprobs(hf, ids)
    assert len(plp) == len(ids) and plp[0] is None
    got = np.array([plp[j][ids[j]] for j in range(1, len(ids))])
    np.testing.assert_allclose(got, ref[np.arange(len(ids) - 1), ids[1:]], atol=2e-4)
    for j in range(1, len(ids)):
        keys = list(plp[j])
        np.testing.assert_allclose([plp[j][t] for t in keys], [ref[j - 1, t] for t in keys], atol=2e-4)
        if k:  # the k most likely tokens (up to float ties), beside the prompt's own
            kth = np.sort(ref[j - 1])[-k]
            assert len(keys) in (k, k + 1) and ids[j] in keys
            assert all(ref[j - 1, t] >= kth - 2e-4 for t in keys if t != ids[j])


@pytest.mark.parametrize("chunk", [128, 16], ids=["unchunked", "chunks-of-16"])
def test_prompt_logprobs_match_hf(bard, hf, prompts, chunk):
    bard.engine.set_step_budget(128, chunk)  # 16: each prompt's rows come from several steps, beside the others
    try:
        outs = bard.generate(prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    finally:
        bard.engine.set_step_budget(128, 128)
    for ids, out in zip(prompts, outs, strict=True):
        check_against_hf(hf, ids, out.prompt_logprobs, k=3)


def test_zero_asks_for_the_prompt_tokens_own_logprob_only(bard, hf, prompts):
    out = bard.generate(prompts[1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])
    check_against_hf(hf, prompts[1], out.prompt_logprobs, k=0)


def test_without_prompt_logprobs_nothing_changes(bard, prompts):
    plain = bard.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    asked = bard.generate(prompts, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1))
    assert all(o.prompt_logprobs is None for o in plain)
    assert [o.token_ids for o in plain] == [o.token_ids for o in asked]


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(bard, hf, prompts):
    ids = prompts[2]
    bard.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    assert bard.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0].num_cached_tokens > 0
    out = bard.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0  # it read no cached KV: every prompt row ran
    check_against_hf(hf, ids, out.prompt_logprobs, k=0)


def test_asynchronous_scheduling_gives_the_same_prompt_logprobs(bard, prompts):
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    sync = bard.generate(prompts, params)
    overlapped = LLM("bard", async_scheduling=True, **ENGINE).generate(prompts, params)
    for a, b in zip(sync, overlapped, strict=True):
        assert a.token_ids == b.token_ids and [None if e is None else set(e) for e in a.prompt_logprobs] == [
            None if e is None else set(e) for e in b.prompt_logprobs]
        np.testing.assert_allclose([v for e in a.prompt_logprobs[1:] for v in e.values()],
                                   [v for e in b.prompt_logprobs[1:] for v in e.values()], atol=1e-5)


@pytest.mark.parametrize("bad", [-1, 21])
def test_prompt_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="^prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=bad)
