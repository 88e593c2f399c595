"""The planner's price of a dispatch: k decode steps a dispatch (`--num-scheduler-steps k`) pay the host's
dispatch overhead once, so each costs (1 - 1/k) x `dispatch_overhead_s` less than a step dispatched alone."""

import json

import pytest

from modelspec.spec import PRESETS
from planner.api import choose_num_scheduler_steps, predict_serving
from planner.hardware import CATALOG
from planner.serving import ServingConfig, Workload
from planner.step_model import decode_shape, prefill_shape, step_time_shape

SPEC = PRESETS["small"]
CPU = CATALOG["cpu"].with_coefficients(dispatch_overhead_s=2e-3)


def test_a_decode_step_of_k_a_dispatch_pays_a_kth_of_the_dispatch():
    one = step_time_shape(SPEC, CPU, decode_shape(4, 300), dtype="fp32").total_s
    four = step_time_shape(SPEC, CPU, decode_shape(4, 300), dtype="fp32", steps_per_dispatch=4).total_s
    assert one - four == pytest.approx(2e-3 * 3 / 4)
    prefill = prefill_shape(64, 0)  # a step with a prefill is dispatched alone: no share
    assert step_time_shape(SPEC, CPU, prefill, dtype="fp32", steps_per_dispatch=4).total_s == \
           step_time_shape(SPEC, CPU, prefill, dtype="fp32").total_s


def test_serving_tpot_falls_by_the_saved_share():
    wl = Workload(input_len=128, output_len=64, concurrency=1)
    one = predict_serving(SPEC, CPU, wl, ServingConfig(dtype="fp32"))
    four = predict_serving(SPEC, CPU, wl, ServingConfig(dtype="fp32", num_scheduler_steps=4))
    assert one.tpot.mean - four.tpot.mean == pytest.approx(2e-3 * 3 / 4 * 1e3, rel=0.05)


def test_the_choice_is_the_fewest_steps_that_hide_the_host():
    assert choose_num_scheduler_steps(SPEC, CATALOG["cpu"], dtype="fp32") == 1  # no overhead measured
    one = step_time_shape(SPEC, CPU, decode_shape(1, 512), dtype="fp32").total_s
    k = choose_num_scheduler_steps(SPEC, CPU, dtype="fp32", share=0.05)
    device = one - 2e-3
    assert 2e-3 / k <= 0.05 * (device + 2e-3 / k) * 1.0001
    assert k == 1 or 2e-3 / (k - 1) > 0.05 * (device + 2e-3 / (k - 1))
    host_bound = CATALOG["h100-sxm"].with_coefficients(dispatch_overhead_s=5e-3)
    assert choose_num_scheduler_steps(PRESETS["llama-3.1-8b"], host_bound, max_steps=8) == 8


def test_plan_takes_the_flag(capsys):
    from jaxserve.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "llama-3.1-8b", "--num-devices", "1", "--input-len", "256", "--output-len", "32",
              "--num-scheduler-steps", "4", "--json"])
    assert e.value.code == 0
    assert json.loads(capsys.readouterr().out)["config"]["num_scheduler_steps"] == 4
