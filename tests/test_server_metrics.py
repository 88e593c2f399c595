"""Engine-state metrics are read from `engine.stats()` at scrape time; disaggregated engines add KV transfers."""

from types import SimpleNamespace

from jaxserve.server.metrics import ServerMetrics

BASE = {"num_running": 2, "num_waiting": 1, "kv_usage": 0.25, "prompt_tokens": 40, "generation_tokens": 9,
        "num_preemptions": 0, "prefix_cache_queries": 40, "prefix_cache_hits": 16}


def scrape(stats: dict) -> str:
    return ServerMetrics(SimpleNamespace(stats=lambda: stats), "m").render().decode()


def test_gauges_and_counters_mirror_the_engine():
    text = scrape(BASE)
    assert 'jaxserve:num_requests_running{model_name="m"} 2.0' in text
    assert 'jaxserve:prefix_cache_hits_total{model_name="m"} 16.0' in text
    assert "kv_transfer" not in text


def test_disaggregated_engines_export_kv_transfers():
    text = scrape({**BASE, "kv_transfers": 3, "kv_transfer_bytes": 4096, "kv_transfer_seconds": 0.5})
    assert 'jaxserve:kv_transfer_bytes_total{model_name="m"} 4096.0' in text
    assert 'jaxserve:kv_transfers_total{model_name="m"} 3.0' in text
