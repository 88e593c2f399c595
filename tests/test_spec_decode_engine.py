"""Speculative decoding in the engine: greedy output is the same token for token as without it (prefix caching,
chunked prefill, preemption and aborts in flight), the rejected tokens' KV is rolled back, and the acceptance
metrics reach the outputs and Prometheus."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.step_outputs import tokens_each_step

# A small pool (33 pages of 16 tokens) so that four long requests preempt one another; chunks of 32 tokens.
ARGS = dict(max_num_seqs=4, max_num_batched_tokens=64, chunk_size=32, page_size=16, kv_cache_memory=33 * 8192,
            max_model_len=256, seq_buckets=(1, 4))  # two sizes: each warm engine compiles every round per size
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
DRAFT = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}  # tiny drafts for itself


@pytest.fixture(scope="module")
def plain():
    return LLM("tiny", **ARGS, warmup=False)  # the reference: it compiles only what the tests run


@pytest.fixture(scope="module")
def ngram_llm():
    return LLM("tiny", **ARGS, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def draft_llm():
    return LLM("tiny", **ARGS, speculative_config=DRAFT)


@pytest.fixture(params=["ngram_llm", "draft_llm"])
def spec(request):
    return request.getfixturevalue(request.param)


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # a repeated phrase, so that n-gram lookup has something to copy
    return [(rng.integers(0, 256, 12).tolist() * 20)[:length] for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def _run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_greedy_output_is_unchanged_with_chunked_prefill_and_preemption(plain, spec):
    # 4 x (72 + 100) tokens in a pool of 512, admitted with no room kept for their outputs: they outgrow the pool
    # and preempt one another; 72 > the 32-token chunk
    prompts = _prompts(4, 72)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    preempted = spec.engine.counters["num_preemptions"]
    sched = spec.engine.scheduler
    saved = sched.config.init_new_token_ratio, sched.config.min_new_token_ratio, sched.new_token_ratio
    sched.config.init_new_token_ratio = sched.config.min_new_token_ratio = sched.new_token_ratio = 0.0
    try:
        assert _run(spec, prompts, params) == _run(plain, prompts, params)
    finally:
        sched.config.init_new_token_ratio, sched.config.min_new_token_ratio, sched.new_token_ratio = saved
    assert spec.engine.counters["num_preemptions"] > preempted


def test_greedy_output_is_unchanged_with_prefix_cache_hits(plain, spec):
    shared = _prompts(1, 80, seed=1)[0]
    prompts = [shared + [5, 6, 7], shared + [9]]
    first = spec.generate(prompts[:1], GREEDY)[0]
    second = spec.generate(prompts[1:], GREEDY)[0]
    assert second.num_cached_tokens >= 64  # whole pages of the shared prefix
    assert [first.token_ids, second.token_ids] == _run(plain, prompts)


def test_proposals_are_verified_and_counted(spec):
    out = spec.generate(_prompts(1, 60, seed=2), GREEDY)[0]
    m = out.metrics
    assert m.spec_num_steps > 0 and m.spec_num_draft_tokens >= m.spec_num_steps
    assert 0 <= m.spec_acceptance_rate <= 1
    assert m.spec_mean_accepted_length == 1 + m.spec_num_accepted_tokens / m.spec_num_steps
    # fewer steps than tokens: accepted drafts came several a step
    assert m.spec_num_accepted_tokens > 0 and len(set(m.token_times)) < len(m.token_times)
    stats = spec.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] == sum(stats[f"spec_decode_num_accepted_tokens_pos{i}"]
                                                           for i in range(3))


def test_tiny_drafting_for_itself_is_accepted_almost_always(draft_llm):
    out = draft_llm.generate(_prompts(2, 40, seed=3), GREEDY)
    rates = [o.metrics.spec_acceptance_rate for o in out]
    assert min(rates) > 0.9, rates


def test_aborts_in_flight_leave_the_others_unchanged(plain, spec):
    prompts = _prompts(3, 70, seed=4)
    want = _run(plain, prompts)
    eng = spec.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"abort-{i}", p, GREEDY)
    done = {}
    for step in range(400):
        if not eng.has_unfinished_requests():
            break
        if step == 6:
            assert eng.abort_request("abort-1").finish_reason == "abort"
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        eng.scheduler.integrity_check()
        for req in eng.scheduler.running:  # rolled back: no page past the computed tokens
            assert len(req.page_ids) == eng.kv_manager.pages_for(req.num_computed_tokens)
    assert done == {"abort-0": want[0], "abort-2": want[2]}


def test_the_prefix_cache_never_holds_a_rejected_token(spec):
    spec.engine.kv_manager.reset_prefix_cache()
    prompts = _prompts(3, 50, seed=5)
    outs = spec.generate(prompts, GREEDY)
    sequences = [tuple(p + o.token_ids) for p, o in zip(prompts, outs, strict=True)]
    tree = spec.engine.kv_manager.tree
    for node in tree.nodes():
        path, n = [], node
        while n is not None and not n.is_root:
            path[:0] = n.key
            n = n.parent
        assert any(seq[: len(path)] == tuple(path) for seq in sequences), path
    assert spec.engine.kv_manager.tree.num_pages > 0


def test_sampled_output_is_reproducible_and_within_bounds(spec):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True)
    a = _run(spec, _prompts(2, 40, seed=6), params)
    b = _run(spec, _prompts(2, 40, seed=6), params)
    assert a == b and all(len(t) == 24 and all(0 <= x < 512 for x in t) for t in a)


def test_nothing_compiles_after_warm_up(spec):
    before = spec.engine.compile_count()
    spec.generate(_prompts(4, 90, seed=7), SamplingParams(temperature=0.7, max_tokens=20, logprobs=2))
    assert spec.engine.compile_count() == before


def test_logprobs_come_with_every_accepted_token(spec):
    out = spec.generate(_prompts(1, 40, seed=8), SamplingParams(temperature=0, max_tokens=16, logprobs=3,
                                                                ignore_eos=True))[0]
    assert len(out.outputs[0].logprobs) == len(out.token_ids) == 16
    for token, entry in zip(out.token_ids, out.outputs[0].logprobs, strict=True):
        assert token in entry and max(entry.values()) == pytest.approx(entry[token], abs=1e-5)  # greedy: the top


def test_stops_inside_accepted_drafts_cut_there(plain, spec):
    prompt = _prompts(1, 60, seed=9)
    ref = _run(plain, prompt)[0]
    stop = ref[10]
    params = SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[stop], ignore_eos=True)
    out = spec.generate(prompt, params)[0]
    assert out.token_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"
    assert spec.engine.scheduler.get_request(out.request_id) is None


def test_a_step_gives_one_output_a_request_however_many_tokens_it_accepted(spec):
    # outputs are cumulative: a round that keeps several tokens describes them in one output, stops checked at each
    grew = tokens_each_step(spec.engine, "several", _prompts(1, 60, seed=10)[0],
                            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert max(grew) > 1 and sum(grew) == 30
    assert spec.engine.scheduler.get_request("several") is None


def test_requests_it_cannot_verify_are_refused(spec):
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        spec.engine.add_request("pen", [1, 2, 3], SamplingParams(presence_penalty=0.5))


def test_prometheus_shows_vllm_spec_decode_names(spec):
    from jaxserve.server.metrics import ServerMetrics

    spec.generate(_prompts(1, 40, seed=10), GREEDY)
    text = ServerMetrics(spec.engine, "tiny").render().decode()
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total"):
        assert f"jaxserve:{name}{{" in text
    assert 'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2"}' in text


@pytest.mark.parametrize("speculative_config, rows", [
    (None, set()),
    ({**NGRAM, "num_speculative_tokens": 4}, {5, 20}),  # S (k + 1) rows for S = 1, 4
])
def test_the_kernel_plan_is_measured_at_the_rows_a_fused_round_runs(monkeypatch, speculative_config, rows):
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine import llm_engine

    class Asked(Exception):
        pass

    def asked(model, kv_caches, **kw):
        raise Asked(kw)

    monkeypatch.setattr(llm_engine, "choose_policy", asked)
    with pytest.raises(Asked) as got:
        llm_engine.LLMEngine(EngineConfig(model="tiny", **ARGS, speculative_config=speculative_config))
    kw = got.value.args[0]
    ladder = {1, 2, 4, 8, 16, 24, 32, 48, 64}  # the token buckets of a 64-token budget
    # the forward's rows among the projections' row counts, the logits rows among the LM head's
    assert set(kw["token_buckets"]) == ladder | rows and set(kw["seq_buckets"]) == {1, 4} | rows
