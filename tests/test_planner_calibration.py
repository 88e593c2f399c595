"""Fitting the step model's coefficients to measured steps, as `jaxserve calibrate` will."""

import dataclasses

import numpy as np
import pytest

from modelspec.spec import PRESETS
from planner.calibration import GEMV_SPEEDUP_RANGE, Sample, fit_coefficients
from planner.hardware import CATALOG, Coefficients, load_hardware, save_profile
from planner.step_model import decode_shape, prefill_shape, step_time_shape

SMALL = PRESETS["small"]


def shapes():
    out = [decode_shape(b, c) for b in (1, 4, 16, 64) for c in (64, 512, 2048)]
    out += [prefill_shape(q, 0) for q in (16, 64, 256, 1024)]
    out += [decode_shape(8, 256) + prefill_shape(128, 0)]
    return out


def test_fit_recovers_the_coefficients_that_made_the_measurements(tmp_path):
    truth = Coefficients(compute_eff=0.45, gemm_m_half=8.0, weight_bw_eff=0.55, kv_bw_eff=0.25, comm_eff=0.5,
                         step_overhead_s=0.004, layer_overhead_s=0.0, seq_overhead_s=8e-5,
                         prefill_token_overhead_s=2e-6)
    cpu = CATALOG["cpu"]
    measured_hw = dataclasses.replace(cpu, coefficients=truth)
    rng = np.random.default_rng(0)
    samples = [Sample(s, step_time_shape(SMALL, measured_hw, s, dtype="fp32").total_s * rng.normal(1, 0.01))
               for s in shapes()]
    # Weight streaming is measured on its own (one model's weight term barely varies between steps).
    fitted, err = fit_coefficients(SMALL, cpu, samples, dtype="fp32", fixed={"weight_bw_eff": 0.55})
    assert err < 0.03
    assert fitted.compute_eff == pytest.approx(0.45, rel=0.15)
    assert fitted.weight_bw_eff == 0.55
    assert fitted.kv_bw_eff == pytest.approx(0.25, rel=0.15)
    # gemm_m_half and the step overhead trade off (a GEMM's time is linear in M with an intercept), so they
    # are not recovered one by one; the predictions they make together are.
    # The fitted profile predicts new steps, and survives a round trip through JSON.
    save_profile(dataclasses.replace(cpu, name="calibrated", coefficients=fitted), tmp_path / "p.json")
    hw = load_hardware(tmp_path / "p.json")
    for new in (decode_shape(32, 1024), decode_shape(2, 4000), decode_shape(4, 100) + prefill_shape(512, 256)):
        assert step_time_shape(SMALL, hw, new, dtype="fp32").total_s == pytest.approx(
            step_time_shape(SMALL, measured_hw, new, dtype="fp32").total_s, rel=0.05)


def test_fit_needs_a_few_samples():
    with pytest.raises(ValueError):
        fit_coefficients(SMALL, CATALOG["cpu"], [Sample(decode_shape(1, 1), 0.01)])


def test_fit_separates_slow_attention_from_the_gemms():
    """A slow attention (CPU jnp kernel) must not drag the GEMMs' efficiency down: short prefills stay exact."""
    truth = Coefficients(compute_eff=0.6, gemm_m_half=8.0, weight_bw_eff=0.9, kv_bw_eff=0.2,
                         step_overhead_s=0.003, layer_overhead_s=0.0, seq_overhead_s=4e-4, attn_eff_scale=0.15)
    cpu = CATALOG["cpu"]
    measured_hw = dataclasses.replace(cpu, coefficients=truth)
    chunks = [decode_shape(4, 140 + 4 * k) + prefill_shape(240, 240 * k) for k in range(4)]
    samples = [Sample(s, step_time_shape(SMALL, measured_hw, s, dtype="fp32").total_s) for s in shapes() + chunks]
    fitted, err = fit_coefficients(SMALL, cpu, samples, dtype="fp32", fixed={"weight_bw_eff": 0.9})
    assert err < 0.03
    assert fitted.attn_eff_scale * fitted.compute_eff == pytest.approx(0.09, rel=0.2)
    hw = dataclasses.replace(cpu, coefficients=fitted)
    for q in (128, 512):
        assert step_time_shape(SMALL, hw, prefill_shape(q), dtype="fp32").total_s == pytest.approx(
            step_time_shape(SMALL, measured_hw, prefill_shape(q), dtype="fp32").total_s, rel=0.05)


def test_fit_prices_a_small_chunk_over_a_long_history():
    """One page of prefill over a 4k history costs far more than its FLOPs (a pass over the KV per chunk):
    the fit learns `attn_m_half` from one-page chunks, and the chunk's cost at a new history follows."""
    truth = Coefficients(compute_eff=0.6, gemm_m_half=8.0, weight_bw_eff=0.9, kv_bw_eff=0.2,
                         step_overhead_s=0.003, layer_overhead_s=0.0, seq_overhead_s=4e-4, attn_eff_scale=0.3,
                         attn_m_half=40.0)
    cpu = CATALOG["cpu"]
    measured_hw = dataclasses.replace(cpu, coefficients=truth)
    small_chunks = [decode_shape(4, 200 + 8 * k) + prefill_shape(16, 256 * k) for k in range(1, 9)]
    samples = [Sample(s, step_time_shape(SMALL, measured_hw, s, dtype="fp32").total_s)
               for s in shapes() + small_chunks]
    fitted, err = fit_coefficients(SMALL, cpu, samples, dtype="fp32", fixed={"weight_bw_eff": 0.9})
    assert err < 0.01
    assert fitted.attn_m_half == pytest.approx(40.0, rel=0.1)
    # 16-row chunks are small (SMALL_CHUNK_ROWS): their pairs get their own efficiency, which finds the truth's.
    assert fitted.attn_small_eff_scale == pytest.approx(0.3, rel=0.1)
    hw = dataclasses.replace(cpu, coefficients=fitted)
    late = decode_shape(4, 300) + prefill_shape(16, 4080)
    assert step_time_shape(SMALL, hw, late, dtype="fp32").total_s == pytest.approx(
        step_time_shape(SMALL, measured_hw, late, dtype="fp32").total_s, rel=0.02)
    # The term matters: priced by its FLOPs alone, the late chunk would come out far too cheap.
    flops_only = dataclasses.replace(cpu, coefficients=dataclasses.replace(fitted, attn_m_half=0.0))
    assert step_time_shape(SMALL, flops_only, late, dtype="fp32").total_s < 0.8 * step_time_shape(
        SMALL, measured_hw, late, dtype="fp32").total_s


def test_the_fit_learns_a_faster_one_row_kernel_from_one_decode_steps():
    """On a CPU one decode token runs XLA's GEMV, which streams weights ~1.3x faster than the 2-16-row GEMMs.
    The fit takes that ratio from the one-decode steps (the other steps pin the per-step overhead), so one- and
    many-row steps are predicted alike; held at 1, the fit would push the one-row steps' gain into the
    overheads and price them slow."""
    truth = Coefficients(compute_eff=0.6, gemm_m_half=0.0, weight_bw_eff=0.7, kv_bw_eff=0.2,
                         step_overhead_s=0.002, layer_overhead_s=0.0, seq_overhead_s=3e-4, gemv_speedup=1.35)
    cpu = CATALOG["cpu"]
    measured_hw = dataclasses.replace(cpu, coefficients=truth)
    samples = [Sample(s, step_time_shape(SMALL, measured_hw, s, dtype="fp32").total_s) for s in shapes()]
    assert any(s.shape.num_decode == 1 and s.shape.prefill_tokens == 0 for s in samples)
    fitted, err = fit_coefficients(SMALL, cpu, samples, dtype="fp32", fixed={"weight_bw_eff": 0.7})
    assert err < 0.01
    assert fitted.gemv_speedup == pytest.approx(1.35, rel=0.02)
    assert fitted.step_overhead_s == pytest.approx(0.002, rel=0.1)
    one_row = decode_shape(1, 300)
    hw = dataclasses.replace(cpu, coefficients=fitted)
    assert step_time_shape(SMALL, hw, one_row, dtype="fp32").total_s == pytest.approx(
        step_time_shape(SMALL, measured_hw, one_row, dtype="fp32").total_s, rel=0.01)
    held, _ = fit_coefficients(SMALL, cpu, samples, dtype="fp32", fixed={"weight_bw_eff": 0.7, "gemv_speedup": 1.0})
    assert held.gemv_speedup == 1.0
    held_hw = dataclasses.replace(cpu, coefficients=held)
    assert step_time_shape(SMALL, held_hw, one_row, dtype="fp32").total_s > 1.05 * step_time_shape(
        SMALL, measured_hw, one_row, dtype="fp32").total_s


def test_a_fitted_one_row_rate_stays_in_its_range():
    """One-decode steps far slower than the rest (a host stall, say) cannot drive the GEMV's rate below half
    the multi-row one's, nor far faster ones above three times it."""
    truth = Coefficients(compute_eff=0.6, gemm_m_half=0.0, weight_bw_eff=0.7, kv_bw_eff=0.2,
                         step_overhead_s=0.002, layer_overhead_s=0.0, seq_overhead_s=3e-4)
    cpu = CATALOG["cpu"]
    measured_hw = dataclasses.replace(cpu, coefficients=truth)
    for scale, bound in ((4.0, GEMV_SPEEDUP_RANGE[0]), (0.2, GEMV_SPEEDUP_RANGE[1])):
        samples = []
        for s in shapes():
            t = step_time_shape(SMALL, measured_hw, s, dtype="fp32").total_s
            samples.append(Sample(s, t * scale if s.num_decode == 1 and s.prefill_tokens == 0 else t))
        fitted, _ = fit_coefficients(SMALL, cpu, samples, dtype="fp32", fixed={"weight_bw_eff": 0.7})
        assert fitted.gemv_speedup == pytest.approx(bound)


def test_small_chunks_are_priced_like_the_others_until_a_profile_prices_them_apart():
    legacy = Coefficients(attn_eff_scale=0.3, attn_m_half=40.0)
    explicit = dataclasses.replace(legacy, attn_small_eff_scale=0.3)
    kernel = dataclasses.replace(legacy, attn_small_eff_scale=0.1)
    cpu = CATALOG["cpu"]

    def step_s(coefficients, shape):
        return step_time_shape(SMALL, dataclasses.replace(cpu, coefficients=coefficients), shape,
                               dtype="fp32").total_s

    small, large = prefill_shape(16, 4000), prefill_shape(128, 4000)
    assert step_s(legacy, small) == pytest.approx(step_s(explicit, small), rel=1e-12)
    assert step_s(kernel, large) == pytest.approx(step_s(legacy, large), rel=1e-12)  # only small chunks move
    assert step_s(kernel, small) != pytest.approx(step_s(legacy, small), rel=0.05)


def test_fit_learns_a_kernel_for_small_chunks_apart_from_the_long_ones():
    """jaxserve's CPU kernel attends chunks of up to SMALL_CHUNK_ROWS rows at a rate of its own, slower per pair
    than the dots of longer chunks: the fit tells the two apart, so a 4-row chunk over a 4k history is predicted
    from 4- and 16-row chunks over shorter ones, and long prefills keep their own pricing."""
    truth = Coefficients(compute_eff=0.6, gemm_m_half=8.0, weight_bw_eff=0.9, kv_bw_eff=0.2,
                         step_overhead_s=0.003, layer_overhead_s=0.0, seq_overhead_s=4e-4, attn_eff_scale=0.3,
                         attn_m_half=2.0, attn_small_eff_scale=0.08)
    cpu = CATALOG["cpu"]
    measured_hw = dataclasses.replace(cpu, coefficients=truth)
    small_chunks = [decode_shape(4, 200 + 8 * k) + prefill_shape(rows, 256 * k) for k in range(1, 9)
                    for rows in (4, 16)]
    long_chunks = [decode_shape(4, 140 + 4 * k) + prefill_shape(256, 256 * k) for k in range(4)]
    samples = [Sample(s, step_time_shape(SMALL, measured_hw, s, dtype="fp32").total_s)
               for s in shapes() + small_chunks + long_chunks]
    fitted, err = fit_coefficients(SMALL, cpu, samples, dtype="fp32", fixed={"weight_bw_eff": 0.9})
    assert err < 0.01
    assert fitted.attn_small_eff_scale * fitted.compute_eff == pytest.approx(0.048, rel=0.1)
    hw = dataclasses.replace(cpu, coefficients=fitted)
    for new in (decode_shape(4, 300) + prefill_shape(4, 4092), prefill_shape(2048, 0)):
        assert step_time_shape(SMALL, hw, new, dtype="fp32").total_s == pytest.approx(
            step_time_shape(SMALL, measured_hw, new, dtype="fp32").total_s, rel=0.03)


def test_small_projections_are_priced_like_other_gemms_until_a_profile_prices_them_apart():
    """`gemm_small_eff_scale` moves the GEMMs of at most SMALL_GEMM_ROWS rows only."""
    legacy = Coefficients(compute_eff=0.6, gemm_m_half=16.0)
    kernel = dataclasses.replace(legacy, gemm_small_eff_scale=0.5)
    cpu = CATALOG["cpu"]

    def step(coefficients, shape):
        return step_time_shape(SMALL, dataclasses.replace(cpu, coefficients=coefficients), shape, dtype="fp32")

    assert step(kernel, decode_shape(64, 100)).total_s == pytest.approx(step(legacy, decode_shape(64, 100)).total_s)
    # 16 rows: the ramp gives 0.6 x 16/32 = 0.3 of peak, the kernel's flat rate 0.6 x 0.5 = 0.3 too
    assert step(kernel, decode_shape(16, 100)).compute_s == pytest.approx(step(legacy, decode_shape(16, 100)).compute_s)
    # 4 rows: the ramp gives 0.6 x 4/20 = 0.12, the kernel 0.3: the projections' FLOPs cost 2.5x less
    assert step(kernel, decode_shape(4, 100)).compute_s < 0.7 * step(legacy, decode_shape(4, 100)).compute_s


def test_fit_learns_the_small_matmul_kernel_apart_from_the_gemm_ramp():
    """jaxserve's CPU matmul kernel runs the projections of steps of up to 32 tokens at a FLOP rate flat in the
    rows, and XLA's GEMM (which ramps with gemm_m_half) the wider ones: the fit tells the two apart, so decode
    steps of 8 and 24 requests and a 512-token prefill are all predicted from the calibration's shapes."""
    truth = Coefficients(compute_eff=0.8, gemm_m_half=32.0, weight_bw_eff=0.7, kv_bw_eff=0.5,
                         step_overhead_s=0.002, layer_overhead_s=0.0, seq_overhead_s=3e-4, gemm_small_eff_scale=0.45)
    cpu = CATALOG["cpu"]
    measured_hw = dataclasses.replace(cpu, coefficients=truth)
    samples = [Sample(s, step_time_shape(SMALL, measured_hw, s, dtype="fp32").total_s) for s in shapes()]
    fitted, err = fit_coefficients(SMALL, cpu, samples, dtype="fp32", fixed={"weight_bw_eff": 0.7})
    assert err < 0.01
    assert fitted.gemm_small_eff_scale * fitted.compute_eff == pytest.approx(0.36, rel=0.05)
    hw = dataclasses.replace(cpu, coefficients=fitted)
    for new in (decode_shape(8, 300), decode_shape(24, 300), prefill_shape(512, 0)):
        assert step_time_shape(SMALL, hw, new, dtype="fp32").total_s == pytest.approx(
            step_time_shape(SMALL, measured_hw, new, dtype="fp32").total_s, rel=0.02)
    # With fewer than MIN_SMALL_GEMM_SAMPLES steps of larger GEMMs the fit keeps one ramped rate for every GEMM.
    few = [s for s in samples if s.shape.num_tokens <= 32] + [s for s in samples if s.shape.num_tokens > 32][:3]
    legacy, _ = fit_coefficients(SMALL, cpu, few, dtype="fp32", fixed={"weight_bw_eff": 0.7})
    assert legacy.gemm_small_eff_scale == 0.0


def test_fit_learns_the_lm_head_kernel_apart_from_the_projections():
    """The kernel's LM head streams the embedding and adds little compute per row, its projections add much
    more: decode steps alone cannot tell the two apart (as many rows of each), steps with a small chunk beside
    their decodes can, and the fit then predicts loaded mixtures of both."""
    truth = Coefficients(compute_eff=0.8, gemm_m_half=32.0, weight_bw_eff=0.7, kv_bw_eff=0.5,
                         step_overhead_s=0.002, layer_overhead_s=0.0, seq_overhead_s=3e-4,
                         gemm_small_eff_scale=0.45, head_small_eff_scale=1.5)
    cpu = CATALOG["cpu"]
    measured_hw = dataclasses.replace(cpu, coefficients=truth)
    mixed = [decode_shape(4, 200 + 40 * k) + prefill_shape(rows, 256 * k) for k in range(1, 5) for rows in (4, 16)]
    samples = [Sample(s, step_time_shape(SMALL, measured_hw, s, dtype="fp32").total_s) for s in shapes() + mixed]
    fitted, err = fit_coefficients(SMALL, cpu, samples, dtype="fp32", fixed={"weight_bw_eff": 0.7})
    assert err < 0.01
    assert fitted.head_small_eff_scale * fitted.compute_eff == pytest.approx(1.2, rel=0.05)
    assert fitted.gemm_small_eff_scale * fitted.compute_eff == pytest.approx(0.36, rel=0.05)
    hw = dataclasses.replace(cpu, coefficients=fitted)
    for new in (decode_shape(12, 300), decode_shape(6, 300) + prefill_shape(20, 500)):
        assert step_time_shape(SMALL, hw, new, dtype="fp32").total_s == pytest.approx(
            step_time_shape(SMALL, measured_hw, new, dtype="fp32").total_s, rel=0.02)
    # Without the small-chunk steps (one 16-token prefill is the only step with fewer head rows than projection
    # rows), the head stays priced with the projections.
    decodes_only, _ = fit_coefficients(SMALL, cpu, samples[: len(shapes())], dtype="fp32",
                                       fixed={"weight_bw_eff": 0.7})
    assert decodes_only.head_small_eff_scale == 0.0


def test_a_padded_prefill_step_pays_per_row_costs_on_its_padding_and_the_fit_learns_them():
    """The runtime computes a step at its token bucket: a 129-token step padded to 192 runs 192 rows of everything
    but attention, so its per-token overhead is paid on 192 - decodes rows; decode-only steps pay none."""
    truth = Coefficients(compute_eff=0.6, gemm_m_half=16.0, weight_bw_eff=0.9, kv_bw_eff=0.3,
                         step_overhead_s=0.003, layer_overhead_s=0.0, seq_overhead_s=1e-4,
                         prefill_token_overhead_s=1.5e-4)
    cpu = CATALOG["cpu"]
    measured_hw = dataclasses.replace(cpu, coefficients=truth)
    mixed = decode_shape(1, 100) + prefill_shape(128, 0)
    plain = step_time_shape(SMALL, measured_hw, mixed, dtype="fp32", padded_tokens=129).total_s
    padded = step_time_shape(SMALL, measured_hw, mixed, dtype="fp32", padded_tokens=192)
    assert padded.overhead_s - step_time_shape(SMALL, measured_hw, mixed, dtype="fp32",
                                               padded_tokens=129).overhead_s == pytest.approx(63 * 1.5e-4)
    assert padded.total_s > plain
    decode = decode_shape(5, 100)
    assert (step_time_shape(SMALL, measured_hw, decode, dtype="fp32", padded_tokens=6).overhead_s
            == step_time_shape(SMALL, measured_hw, decode, dtype="fp32").overhead_s)
    # Measurements made at buckets: the fit, told each step's bucket, predicts a padded step it never saw.
    buckets = {16: 16, 64: 64, 136: 192, 256: 256, 264: 384, 1024: 1024}
    samples = [Sample(s, step_time_shape(SMALL, measured_hw, s, dtype="fp32").total_s) for s in shapes()
               if s.prefill_tokens == 0]
    samples += [Sample(prefill_shape(n, 0), step_time_shape(SMALL, measured_hw, prefill_shape(n, 0), dtype="fp32",
                                                            padded_tokens=b).total_s, b) for n, b in buckets.items()]
    fitted, err = fit_coefficients(SMALL, cpu, samples, dtype="fp32", fixed={"weight_bw_eff": 0.9})
    assert err < 0.02
    fhw = dataclasses.replace(cpu, coefficients=fitted)
    new = decode_shape(4, 128) + prefill_shape(130, 0)
    assert step_time_shape(SMALL, fhw, new, dtype="fp32", padded_tokens=192).total_s == pytest.approx(
        step_time_shape(SMALL, measured_hw, new, dtype="fp32", padded_tokens=192).total_s, rel=0.03)
