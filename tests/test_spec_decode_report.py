"""`jaxserve report --speculative-config`: the speculative row, measured against the planner, and its table."""

import json

import pytest

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.measure.report.context import Context, ReportConfig
from jaxserve.measure.report.speculative import markdown, run_speculative
from planner.hardware import load_hardware
from planner.speculative import verify_step_s

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def test_the_speculative_row_prices_what_the_run_measured():
    # no warm-up: the test checks the row's arithmetic, and each shape compiles in a round the run drops anyway
    engine = LLMEngine(EngineConfig(model="tiny", max_num_seqs=2, max_num_batched_tokens=64, chunk_size=64,
                                    kv_cache_memory=2**20, max_model_len=256, seq_buckets=(1, 2), warmup=False))
    cfg = ReportConfig(model="tiny", speculative=json.dumps(NGRAM), spec_prompt_len=48, spec_output_len=24,
                       spec_repeats=1)
    hw = load_hardware("h100-sxm")  # the row's arithmetic, not its accuracy: that is the report's job on a profile
    ctx = Context(engine=engine, spec=engine.spec, hw=hw, dtype="fp32", cfg=cfg, log=lambda m: None)
    (row,) = run_speculative(ctx)
    assert row["kind"] == "speculative" and row["config"]["k"] == 3
    assert row["measured_tpot_ms"] > 0 and row["measured_plain_tpot_ms"] > 0
    assert row["verify_steps"] > 0 and 1 <= row["tokens_per_verify_step"] <= 4
    # each verify step priced at the drafts it verified on average (n-gram lookup may find fewer than k)
    d = row["drafts_per_verify_step"]
    assert 1 <= d <= 3

    def verify(n):
        buckets = engine.runner.token_buckets
        return 1e3 * verify_step_s(engine.spec, hw, 1, 48 + 12, n, dtype="fp32", token_buckets=buckets)

    lo = int(d)
    expected = verify(lo) if d == lo else verify(lo) + (d - lo) * (verify(lo + 1) - verify(lo))
    assert row["predicted_verify_step_ms"] == pytest.approx(expected)
    assert row["predicted_proposer_ms"] == 0.0  # n-gram lookup
    plain_steps, verify_steps = row["plain_steps"], row["verify_steps"]
    assert row["predicted_tpot_ms"] == pytest.approx(
        (verify_steps * row["predicted_verify_step_ms"] + plain_steps * row["predicted_plain_tpot_ms"]) / 23)
    # the round itself beside the TPOT: its median wall time against its price, and a plain step's
    assert row["predicted_round_ms"] == pytest.approx(row["predicted_verify_step_ms"] + row["predicted_proposer_ms"])
    assert row["measured_round_ms"] > 0 and row["measured_plain_step_ms"] > 0
    table = markdown({"rows": [row]})
    assert table[0] == "## Speculative decoding (one request)" and "| ngram" in table[4]
