"""The planner's speculative-decoding prediction: tokens per verify step, the verify step's and the proposer's
costs, TPOT, the choice of k, and `jaxserve plan --speculative-k K --acceptance A`."""

import json
import subprocess
import sys

import pytest

from modelspec.spec import load_model_spec
from planner import PlanRequest, plan
from planner.hardware import load_hardware
from planner.speculative import (
    acceptance_from_tokens_per_step,
    choose_k,
    expected_tokens_per_step,
    predict_speculative,
    proposer_s,
    verify_step_s,
)
from planner.step_model import decode_shape, step_time_shape

TARGET, DRAFT, HW = load_model_spec("llama-3.1-70b"), load_model_spec("llama-3.1-8b"), load_hardware("h100-sxm")


def test_expected_tokens_per_verify_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0  # nothing accepted: the target's own token
    assert expected_tokens_per_step(1.0, 4) == 5.0  # everything: k drafts and the bonus
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert acceptance_from_tokens_per_step(expected_tokens_per_step(0.63, 5), 5) == pytest.approx(0.63)
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.2, 3)


def test_a_verify_step_costs_little_more_than_a_decode_step_when_weights_bind():
    decode = step_time_shape(TARGET, HW, decode_shape(1, 1024)).total_s
    verify = verify_step_s(TARGET, HW, 1, 1024, 4)
    assert decode < verify < 1.1 * decode


def test_proposer_costs():
    assert proposer_s("ngram", HW, 1, 512, 4) == 0.0
    one = step_time_shape(DRAFT, HW, decode_shape(1, 512)).total_s
    fixed = HW.coefficients.step_overhead_s
    assert proposer_s("draft_model", HW, 1, 512, 4, draft=DRAFT) == pytest.approx(4 * (one - fixed), rel=0.01)
    with pytest.raises(ValueError, match="draft model's spec"):
        proposer_s("draft_model", HW, 1, 512, 4)


def test_the_draft_steps_ride_the_rounds_one_dispatch():
    # the draft's k steps run inside the round's jitted call: none pays a step's fixed overhead (the verify step
    # pays the round's), each keeps its layers' and its sequences' overheads, and no dispatch is added
    hw = HW.with_coefficients(step_overhead_s=300e-6, dispatch_overhead_s=200e-6, layer_overhead_s=10e-6,
                              seq_overhead_s=50e-6)
    steps = [step_time_shape(DRAFT, hw, decode_shape(1, 512 + i)).total_s for i in range(4)]
    assert proposer_s("draft_model", hw, 1, 512, 4, draft=DRAFT) == pytest.approx(sum(steps) - 4 * 300e-6)
    bigger = HW.with_coefficients(step_overhead_s=300e-6, dispatch_overhead_s=5e-3, layer_overhead_s=10e-6,
                                  seq_overhead_s=50e-6)
    assert proposer_s("draft_model", bigger, 1, 512, 4, draft=DRAFT) == pytest.approx(
        proposer_s("draft_model", hw, 1, 512, 4, draft=DRAFT))


def test_a_verify_steps_draft_rows_add_gemm_rows_to_the_lm_head_not_sequences():
    # a CPU-like profile whose LM head rate (fitted on decode steps, one row a sequence) is far below its GEMMs'
    cpu = load_hardware("h100-sxm").with_coefficients(gemm_small_eff_scale=0.4, head_small_eff_scale=0.05)
    spec = load_model_spec("bard")
    one_row = verify_step_s(spec, cpu, 1, 160, 1, dtype="fp32")
    five_rows = verify_step_s(spec, cpu, 1, 160, 4, dtype="fp32")
    # what 4 more sequences' LM head rows would cost at the head's rate
    four_heads = 4 * cpu.coefficients.head_small_eff_scale ** -1 * 2 * spec.hidden_size * spec.vocab_size / (
        cpu.peak("fp32") * cpu.coefficients.compute_eff)
    assert five_rows - one_row < 0.5 * four_heads
    assert five_rows > one_row  # the rows still cost their FLOPs and activations


def test_tpot_is_the_step_over_the_tokens_it_emits():
    p = predict_speculative(TARGET, HW, k=4, acceptance=0.7, draft=DRAFT)
    assert p.tpot_s == pytest.approx((p.verify_step_s + p.proposer_s) / expected_tokens_per_step(0.7, 4))
    assert p.speedup > 1.3  # a 70B target with an 8B draft at 70% acceptance, one sequence
    measured = predict_speculative(TARGET, HW, k=4, acceptance=0.7, draft=DRAFT, tokens_per_step=2.0)
    assert measured.tpot_s == pytest.approx((p.verify_step_s + p.proposer_s) / 2.0)


def test_the_choice_of_k_follows_acceptance_and_proposer_cost():
    low = choose_k(TARGET, HW, acceptance=0.3, draft=DRAFT)
    high = choose_k(TARGET, HW, acceptance=0.9, draft=DRAFT)
    free = choose_k(TARGET, HW, acceptance=0.9, method="ngram")
    assert low.k < high.k <= free.k
    assert all(free.tpot_s <= predict_speculative(TARGET, HW, k=k, acceptance=0.9, method="ngram").tpot_s
               for k in range(1, 9))


def test_the_plan_api_and_json():
    result = plan(PlanRequest(model=TARGET, hardware=HW, num_devices=4, tp=4, concurrency=1, speculative_k=3,
                              acceptance=0.8, draft_model=DRAFT))
    sp = result.to_json()["speculative"]
    assert sp["k"] == 3 and sp["tpot_ms"] < sp["decode_step_ms"] and 1 <= sp["best_k"] <= 8
    assert sp["tokens_per_step"] == pytest.approx(expected_tokens_per_step(0.8, 3))


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve", "plan", *args], capture_output=True, text=True,
                          timeout=120)


def test_plan_command_line():
    r = _plan("--model", "llama-3.1-8b", "--concurrency", "1", "--speculative-k", "4", "--acceptance", "0.6",
              "--speculative-method", "ngram", "--json")
    assert r.returncode == 0, r.stderr
    sp = json.loads(r.stdout)["speculative"]
    assert sp["method"] == "ngram" and sp["proposer_ms"] == 0.0 and sp["speedup"] > 1
    for bad in (["--speculative-k", "4"], ["--speculative-k", "4", "--acceptance", "1.5"],
                ["--speculative-k", "0", "--acceptance", "0.5"], ["--speculative-k", "2", "--acceptance", "0.5"]):
        r = _plan(*bad)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (bad, r.stderr)
