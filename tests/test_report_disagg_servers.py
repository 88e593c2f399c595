"""`jaxserve report --disagg P+D` on a CPU measures a prefill server and a decode server, separate processes each
pinned to its own core: their pool counters in /metrics, the rows against the planner, no server left behind."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from jaxserve.core.outputs import StepStats
from jaxserve.engine.pool_stats import POOL_COUNTERS, StepPoolCounters, pool_rates
from jaxserve.measure.report import disagg_servers
from jaxserve.measure.report.context import Context, ReportConfig
from jaxserve.measure.report.disagg import markdown, summarize_disagg
from jaxserve.measure.report.disagg_servers import calibrate_pinned, parse_counters, run_disagg_servers
from jaxserve.platform.devices import device_facts
from jaxserve.server.metrics import POOL_COUNTER_DOCS
from modelspec.spec import load_model_spec
from planner.disaggregate import pool_balance
from planner.hardware import load_hardware

TWO_CORES = len(os.sched_getaffinity(0)) >= 2
EXPOSITION = """# HELP jaxserve:prefill_busy_seconds_total Seconds of engine steps that ran prefill rows.
# TYPE jaxserve:prefill_busy_seconds_total counter
jaxserve:prefill_busy_seconds_total{model_name="tiny"} 1.5
jaxserve:prefill_prompts_total{model_name="tiny"} 6.0
jaxserve:prefill_prompts_total{model_name="other"} 2.0
jaxserve:num_requests_running{model_name="tiny"} 3.0
"""


def test_parse_counters_sums_labels_and_names_what_is_missing():
    assert parse_counters(EXPOSITION, ["prefill_busy_seconds", "prefill_prompts"]) == {
        "prefill_busy_seconds": 1.5, "prefill_prompts": 8.0}
    with pytest.raises(ValueError, match="no jaxserve:decode_steps_total"):
        parse_counters(EXPOSITION, ["prefill_prompts", "decode_steps"])


def _step(duration: float, prefill_tokens: int, decodes: int, prompts_done: int) -> StepStats:
    return StepStats(time=0.0, duration=duration, num_tokens=prefill_tokens + decodes,
                     num_prefill_tokens=prefill_tokens, num_decode_tokens=decodes, num_running=0, num_waiting=0,
                     kv_usage=0.0, num_preemptions=0, prefix_queries=0, prefix_hits=0,
                     num_prompts_done=prompts_done)


def test_a_role_servers_steps_count_for_its_pool():
    pools = StepPoolCounters()
    for stats in (_step(0.2, 32, 0, 1), _step(0.3, 64, 0, 1), _step(0.1, 0, 4, 0), _step(0.1, 0, 2, 0)):
        pools.on_step(stats)
    rates = pool_rates(pools.counters)
    assert rates["prefill_prompts_per_busy_s"] == pytest.approx(2 / 0.5)
    assert rates["prefill_tokens_per_busy_s"] == pytest.approx(96 / 0.5)
    assert rates["decode_tokens_per_busy_s"] == pytest.approx(6 / 0.2)
    assert rates["decode_mean_batch"] == pytest.approx(3.0)
    assert set(POOL_COUNTER_DOCS) == set(POOL_COUNTERS)  # /metrics names every counter


def _context(**overrides) -> Context:
    cfg = replace(ReportConfig.quick_config("tiny"), disagg=(1, 1), **overrides)
    return Context(engine=None, spec=load_model_spec("tiny"), hw=load_hardware("cpu"), dtype="fp32", cfg=cfg,
                   facts=device_facts(), log=lambda _: None)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _processes_naming(text: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


@pytest.mark.skipif(not TWO_CORES, reason="a core for each server")
def test_two_pinned_servers_give_each_pools_capacity_against_the_planner():
    ctx = _context()
    ctx.pool_hw = load_hardware("h200")  # the pools' own profile, where the report has one, prices them
    rows = {r["config"]["quantity"]: r for r in run_disagg_servers(ctx)}
    assert list(rows) == ["prefill_capacity", "decode_capacity", "balance", "kv_bytes_per_request"]
    pre, dec, bal, kv = rows.values()
    c = pre["config"]
    assert c["mode"] == "processes" and c["prefill_cores"] != c["decode_cores"]
    assert pre["completed"] == 6 and pre["steps"] == 6  # one whole prompt per prefill step, on the prefill server
    for r in (pre, dec, bal):
        assert math.isfinite(r["measured"]) and r["measured"] > 0 and math.isfinite(r["predicted"])
    assert pre["measured"] == pytest.approx(6 / pre["busy_seconds"])
    assert dec["measured"] == pytest.approx(6 * 3 / dec["busy_seconds"] / 3)  # 3 of the 4 tokens decoded there
    assert 1 <= dec["decode_batch"] <= 4 and 0 < dec["busy_fraction"] <= 1
    for r, work in ((pre, 6), (dec, 6)):  # the same work per CPU second of its server process
        assert r["cpu_seconds"] > 0 and r["measured_per_cpu_second"] == pytest.approx(work / r["cpu_seconds"])
    planned = pool_balance(ctx.spec, ctx.pool_hw, 32, 4, decode_batch=dec["decode_batch"], dtype="fp32")
    assert (pre["predicted"], dec["predicted"]) == pytest.approx((planned.prefill_rps, planned.decode_rps))
    assert kv["transfers"] == 6 and kv["measured"] == kv["predicted"]
    assert summarize_disagg(list(rows.values()))["mode"] == "processes"
    md = "\n".join(markdown({"rows": list(rows.values())}))
    assert "two server processes (prefill on cores" in md and "| prefill capacity | req/s |" in md
    assert "Per CPU second of each server process" in md
    # Both servers and whatever they started are gone once the part is done.
    assert all(_gone(pid) for pid in c["server_pids"].values())
    for url in c["server_urls"].values():
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
        assert _processes_naming(f"--port {url.rsplit(':', 1)[1]} ") == []


@pytest.mark.skipif(not TWO_CORES, reason="a core for each server")
def test_a_server_that_cannot_start_fails_the_part_in_one_line_and_leaves_nothing(monkeypatch):
    started, caches = [], []

    def launch(args, *rest, **kwargs):
        proc = real_launch(args, *rest, **kwargs)
        started.append(proc)
        caches.append(args[args.index("--compilation-cache-dir") + 1])
        return proc

    real_launch = disagg_servers.launch
    monkeypatch.setattr(disagg_servers, "launch", launch)
    with pytest.raises(RuntimeError, match=r"exited with 2: .*no-such-model.*\(log "):
        run_disagg_servers(_context(model="no-such-model"))
    assert started and all(p.poll() is not None for p in started)
    assert len(set(caches)) == len(caches) == 2  # servers started side by side never share a compilation cache


def test_a_profile_calibrated_on_one_core_prices_the_pools(tmp_path):
    """A pool's server runs on its own cores: the report calibrates a profile there (`jaxserve calibrate` pinned)."""
    cfg = ReportConfig.quick_config("tiny")
    path = calibrate_pinned(cfg, [0], tmp_path / "pool-profile.json", log=lambda _: None)
    hw = load_hardware(str(path))
    assert hw.coefficients.to_dict() and (tmp_path / "pool-profile.log").read_text()
    engine = cfg.engine_config()  # the engine the report calibrates on every core, pinned here
    measured = json.loads(path.read_text())["measurements"]["engine"]
    assert (measured["max_num_seqs"], measured["max_num_batched_tokens"]) == (engine.max_num_seqs,
                                                                             engine.max_num_batched_tokens)
    assert math.isfinite(pool_balance(load_model_spec("tiny"), hw, 32, 4, dtype="fp32").prefill_rps)
    with pytest.raises(ValueError, match=r"calibration pinned to cores \[0\] failed \(exit 2\)"):
        calibrate_pinned(replace(cfg, model="no-such-model"), [0], tmp_path / "bad.json", log=lambda _: None)
