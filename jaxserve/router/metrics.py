"""The router's /metrics in Prometheus' text format: per-server health, load and counts, and its own totals."""

from __future__ import annotations

from jaxserve.router.workers import Worker


def render_metrics(workers: list[Worker], counters: dict[str, int], uptime_s: float) -> str:
    """Gauges `jaxserve_router:worker_healthy`, `worker_load`, counters `worker_requests_total`,
    `worker_errors_total` (labels url, role), and the router's `requests_total`, `retries_total`, `failures_total`."""
    lines = []

    def family(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP jaxserve_router:{name} {doc}", f"# TYPE jaxserve_router:{name} {kind}"])
        lines.extend(f"jaxserve_router:{name}{labels} {value}" for labels, value in samples)

    def per(attr: str) -> list[tuple[str, float]]:
        return [(f'{{url="{w.url}",role="{w.role}"}}', float(getattr(w, attr))) for w in workers]

    family("worker_healthy", "gauge", "1 while the server is in rotation.", per("healthy"))
    family("worker_load", "gauge", "Requests in flight on the server through this router.", per("load"))
    family("worker_requests_total", "counter", "Requests sent to the server (attempts).", per("requests"))
    family("worker_errors_total", "counter", "Requests the server failed (connection lost, stalled).", per("errors"))
    for name, doc in (("requests", "Requests received."), ("retries", "Attempts on another server after a failure."),
                      ("failures", "Requests answered with an error or cut mid-stream by a server failure.")):
        family(f"{name}_total", "counter", doc, [("", float(counters[name]))])
    family("uptime_seconds", "gauge", "Seconds since the router started.", [("", round(uptime_s, 3))])
    return "\n".join(lines) + "\n"
