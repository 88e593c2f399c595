"""Engine-state metrics are read from `engine.stats()` at scrape time; disaggregated engines add KV transfers."""

from types import SimpleNamespace

from jaxserve.config.engine import EngineConfig
from jaxserve.server.metrics import ServerMetrics, token_buckets

BASE = {"num_running": 2, "num_waiting": 1, "kv_usage": 0.25, "prompt_tokens": 40, "generation_tokens": 9,
        "num_preemptions": 0, "prefix_cache_queries": 40, "prefix_cache_hits": 16}


def scrape(stats: dict) -> str:
    engine = SimpleNamespace(stats=lambda: stats, config=EngineConfig(model="tiny", page_size=16), max_model_len=512)
    return ServerMetrics(engine, "m").render().decode()


def test_gauges_and_counters_mirror_the_engine():
    text = scrape(BASE)
    assert 'jaxserve:num_requests_running{model_name="m"} 2.0' in text
    assert 'jaxserve:prefix_cache_hits_total{model_name="m"} 16.0' in text
    assert "kv_transfer" not in text


def test_disaggregated_engines_export_kv_transfers():
    text = scrape({**BASE, "kv_transfers": 3, "kv_transfer_bytes": 4096, "kv_transfer_seconds": 0.5})
    assert 'jaxserve:kv_transfer_bytes_total{model_name="m"} 4096.0' in text
    assert 'jaxserve:kv_transfers_total{model_name="m"} 3.0' in text


def test_the_cache_config_is_a_labelled_gauge_as_in_vllm():
    text = scrape(BASE)
    line = next(x for x in text.splitlines() if x.startswith("jaxserve:cache_config_info{"))
    assert 'block_size="16"' in line and 'enable_prefix_caching="True"' in line and line.endswith(" 1.0")


def test_length_histograms_use_vllms_1_2_5_buckets_up_to_the_context():
    assert token_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert token_buckets(1) == [1]
