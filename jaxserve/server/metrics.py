"""Prometheus metrics with vLLM's names under the `jaxserve:` prefix, and vLLM's periodic stats log line.

Gauges and counters that mirror engine state (running/waiting, KV usage, token and prefix-cache totals,
preemptions) are read from `engine.stats()` at scrape time, so a scrape after the engine goes idle shows its
true state. Latency histograms are fed by the engine observer from the engine's monotonic timestamps
(`RequestOutput.metrics`); `iteration_tokens_total` from each step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.core.outputs import RequestOutput, StepStats

logger = logging.getLogger("jaxserve.server")

P = "jaxserve:"
POOL_COUNTER_DOCS = {  # the keys of `jaxserve.engine.pool_stats.POOL_COUNTERS`
    "prefill_steps": "Engine steps that ran prefill rows.",
    "prefill_busy_seconds": "Seconds of engine steps that ran prefill rows.",
    "prefill_prompts": "Prompts whose prefill finished.",
    "prefill_prompt_tokens": "Prompt tokens run in prefill steps.",
    "decode_steps": "Engine steps of decodes only.",
    "decode_busy_seconds": "Seconds of engine steps of decodes only.",
    "decode_output_tokens": "Tokens drawn by decode-only steps.",
    "decode_batch_seqs": "Sequences summed over decode-only steps (divided by the steps: the mean batch).",
}
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                          20.0, 40.0, 80.0]
_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_N_BUCKETS = [1, 2, 5, 10, 20]  # vLLM's request_params_n buckets


def token_buckets(max_model_len: int) -> list[float]:
    """vLLM's 1-2-5 buckets up to the context (`build_1_2_5_buckets`): 1, 2, 5, 10, 20, 50, ..."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(float(m * scale))
        scale *= 10


class _EngineStateCollector(Collector):
    """Gauges and counters read from `engine.stats()` on every scrape."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        label = [self.model_name]
        gauges = [("num_requests_running", "Number of requests in model execution batches.", "num_running"),
                  ("num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
                  ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage")]
        for name, doc, key in gauges:
            g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            g.add_metric(label, float(s.get(key, 0)))
            yield g
        counters = [("prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
                    ("generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
                    ("num_preemptions", "Cumulative number of preemptions from the engine.", "num_preemptions"),
                    ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                     "prefix_cache_queries"),
                    ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                     "prefix_cache_hits")]
        if "kv_transfers" in s:  # disaggregated engines: KV moved from the prefill pool to the decode pool
            counters += [("kv_transfers", "Requests whose KV moved to the decode pool.", "kv_transfers"),
                         ("kv_transfer_bytes", "KV bytes moved to the decode pool.", "kv_transfer_bytes"),
                         ("kv_transfer_seconds", "Seconds spent moving KV to the decode pool.",
                          "kv_transfer_seconds")]
        if "prefill_busy_seconds" in s:  # a pool's busy time and work (engine/pool_stats.py): disaggregated roles
            counters += [(k, POOL_COUNTER_DOCS[k], k) for k in POOL_COUNTER_DOCS]
        if "process_cpu_seconds" in s:
            counters += [("process_cpu_seconds", "CPU seconds used by this server process, all its threads.",
                          "process_cpu_seconds")]
        if "spec_decode_num_drafts" in s:  # speculative decoding (vLLM's spec_decode_* names)
            counters += [("spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_decode_num_drafts"),
                         ("spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_decode_num_draft_tokens"),
                         ("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          "spec_decode_num_accepted_tokens")]
            per_pos = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.", labels=["model_name", "position"])
            pos = 0
            while f"spec_decode_num_accepted_tokens_pos{pos}" in s:
                per_pos.add_metric([self.model_name, str(pos)], float(s[f"spec_decode_num_accepted_tokens_pos{pos}"]))
                pos += 1
            yield per_pos
        for name, doc, key in counters:
            c = CounterMetricFamily(P + name, doc, labels=["model_name"])
            c.add_metric(label, float(s.get(key, 0)))
            yield c
        yield self.cache_config_info()

    def cache_config_info(self) -> GaugeMetricFamily:
        """vLLM's `cache_config_info`: the KV cache's configuration as labels of a gauge of 1."""
        c = self.engine.config
        info = {"block_size": str(c.page_size), "cache_dtype": str(c.kv_cache_dtype),
                "enable_prefix_caching": str(c.enable_prefix_caching),
                "gpu_memory_utilization": str(c.gpu_memory_utilization),
                "kv_cache_memory_bytes": "" if c.kv_cache_memory is None else str(c.kv_cache_memory)}
        g = GaugeMetricFamily(P + "cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=list(info))
        g.add_metric(list(info.values()), 1.0)
        return g


class ServerMetrics:
    """All server metrics in one registry; `on_step` / `on_request_finished` make it an engine observer."""

    def __init__(self, engine: Any, model_name: str) -> None:
        disable_created_metrics()  # no `*_created` series, as vLLM
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStateCollector(engine, model_name))

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            h = Histogram(P + name, doc, ["model_name"], buckets=buckets, registry=self.registry)
            return h.labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        _TOKEN_LATENCY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", _TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        _REQUEST_LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                          _REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                            _REQUEST_LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                           _REQUEST_LATENCY_BUCKETS)
        lengths = token_buckets(engine.max_model_len)
        self.prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens processed.", lengths)
        self.generation_tokens = hist("request_generation_tokens", "Number of generation tokens processed.",
                                      lengths)
        self.params_n = hist("request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        self.params_max_tokens = hist("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                      lengths)
        self.inference = hist("request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     _ITERATION_BUCKETS)
        self._success = Counter(P + "request_success", "Count of successfully processed requests.",
                                ["model_name", "finished_reason"], registry=self.registry)

    # ---- engine observer (called from the engine thread; prometheus-client is thread-safe) ----

    def on_step(self, stats: StepStats) -> None:
        if stats.num_tokens > 0:
            self.iteration_tokens.observe(stats.num_tokens)

    def on_request_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e),
                            (self.queue, m.queue_time), (self.prefill, m.prefill_time),
                            (self.decode, m.decode_time)):
            if value is not None:
                hist.observe(max(value, 0.0))
        if m.prefill_time is not None and m.decode_time is not None:
            self.inference.observe(max(m.prefill_time + m.decode_time, 0.0))
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(sum(len(o.token_ids) for o in out.outputs))
        for gap in m.itls:
            self.itl.observe(max(gap, 0.0))
        reason = out.outputs[0].finish_reason if out.outputs else None
        self._success.labels(self.model_name, reason or "abort").inc()

    def on_request_params(self, n: int, max_tokens: int) -> None:
        """A request's `n` and its (resolved) `max_tokens`, as the HTTP layer sees them."""
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class StatsLogger:
    """vLLM-style periodic line: throughput since the last line, running/waiting, KV usage, prefix hit rate."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._last_time = time.monotonic()
        self._last = dict(engine.stats())
        self._was_idle = True

    def line(self) -> str | None:
        """The next log line, or None when the engine was idle since the last one."""
        now = time.monotonic()
        s = dict(self.engine.stats())
        dt = max(now - self._last_time, 1e-9)

        def delta(key: str) -> float:
            return float(s.get(key, 0)) - float(self._last.get(key, 0))

        prompt_tps, gen_tps = delta("prompt_tokens") / dt, delta("generation_tokens") / dt
        queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
        self._last_time, self._last = now, s
        idle = prompt_tps == 0 and gen_tps == 0 and not s.get("num_running") and not s.get("num_waiting")
        if idle and self._was_idle:
            return None
        self._was_idle = idle
        hit_rate = 100.0 * hits / queries if queries > 0 else 0.0
        return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} "
                f"tokens/s, Running: {s.get('num_running', 0)} reqs, Waiting: {s.get('num_waiting', 0)} reqs, "
                f"KV cache usage: {100.0 * float(s.get('kv_usage', 0.0)):.1f}%, "
                f"Prefix cache hit rate: {hit_rate:.1f}%")

    def log(self) -> None:
        line = self.line()
        if line is not None:
            logger.info(line)
