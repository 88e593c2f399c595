"""`jaxserve calibrate`: quick measurements on the session's tiny engine produce a profile `plan` accepts."""

import json

import pytest
from click.testing import CliRunner

from jaxserve.measure.calibrate.calibrate import CalibrationConfig, calibrate
from jaxserve.measure.calibrate.steps import decode_tokens, fit_decode_context, step_budget
from planner.hardware import load_hardware


@pytest.fixture(scope="module")
def calibration(tiny_llm):
    return calibrate(tiny_llm.engine, CalibrationConfig.quick())


def test_profile_is_accepted_by_plan(calibration, tmp_path):
    path = tmp_path / "profile.json"
    calibration.save(path)
    hw = load_hardware(path)
    assert hw.memory_bw > 1e8 and hw.peak("fp32") > 1e8
    c = hw.coefficients
    assert 0 < c.compute_eff <= 1.5 and 0 < c.kv_bw_eff <= 1.5 and c.step_overhead_s >= 0
    data = json.loads(path.read_text())
    assert {"measurements", "device", "notes", "coefficients"} <= set(data)
    assert data["measurements"]["steps"] and data["measurements"]["gemm_rows"]
    from jaxserve.cli.main import cli

    res = CliRunner().invoke(cli, ["plan", "--model", "tiny", "--hardware", str(path), "--dtype", "fp32",
                                   "--input-len", "64", "--output-len", "16", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["hardware"] == hw.name


def test_samples_cover_prefill_decode_and_mixed_steps(calibration):
    kinds = {s.kind for s in calibration.samples}
    assert kinds == {"prefill", "decode", "mixed"}
    assert all(s.seconds > 0 for s in calibration.samples)
    assert len(calibration.fit.errors) == len(calibration.samples)
    assert calibration.fit.fixed["weight_bw_eff"] > 0
    # Two rows stream the weights as a decode of a few requests does: held as weight_bw_eff. One row runs
    # another kernel on a CPU; its rate is fitted from the one-decode steps, within its range.
    m = calibration.measurements
    assert "gemv_speedup" not in calibration.fit.fixed
    assert m["weight_stream_gbps"] > 0 and m["weight_stream_2_rows_gbps"] > 0
    assert any(s.shape.num_decode == 1 and s.shape.prefill_tokens == 0 for s in calibration.samples)
    assert 0.5 <= calibration.hardware.coefficients.gemv_speedup <= 3.0
    # The host's share of a dispatch, from one request at one and at several decode steps a dispatch.
    assert calibration.hardware.coefficients.dispatch_overhead_s == pytest.approx(m["dispatch_overhead_ms"] / 1e3)
    assert m["dispatch_overhead_ms"] >= 0 and 1 <= m["recommended_num_scheduler_steps"] <= 8


def test_step_budget_restores_the_scheduler(tiny_llm):
    sc = tiny_llm.engine.scheduler.config
    before = (sc.max_num_batched_tokens, sc.chunk_size)
    with step_budget(tiny_llm.engine, 32):
        assert (sc.max_num_batched_tokens, sc.chunk_size) == (32, 32)
    assert (sc.max_num_batched_tokens, sc.chunk_size) == before


def test_decode_points_longer_than_the_model_are_measured_at_the_longest_context_that_fits():
    # bard holds 512 tokens: a 512-token point of 10 steps needs 525, so it is measured at 499.
    assert decode_tokens(1, 512, 10, 512) == 525
    assert fit_decode_context(1, 512, 10, 512, 512) == 499
    assert decode_tokens(1, 499, 10, 512) <= 512
    assert fit_decode_context(4, 64, 10, 128, 8192) == 64  # a point that fits is left alone
