"""Per-request records and vLLM's "Serving Benchmark Result": metrics, the printed summary, the JSON keys.

Definitions (as ../shared/GUIDE.md, outside the repository, gives them): TTFT = arrival to first token; TPOT per
request = (E2E - TTFT) / (out - 1), over requests with at least two tokens; ITL = every gap between consecutive
tokens; E2E = arrival to last token; goodput = completed requests per second that meet every given SLO (ttft,
tpot, e2el, in ms).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
_TITLES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


@dataclass
class RequestRecord:
    """What the client saw of one request (seconds, relative to its own arrival)."""

    prompt_len: int
    success: bool = False
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache, when known
    arrival: float = 0.0  # seconds since the benchmark started
    role: str = "request"
    # Speculative decoding (in-process runs): verify steps with drafts, tokens proposed, tokens accepted.
    spec_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (out - 1); None with fewer than two output tokens."""
        if not self.success or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); ValueError when malformed."""
    slos: dict[str, float] = {}
    for item in items:
        for part in item.split():
            name, sep, value = part.partition(":")
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--goodput takes KEY:MS with KEY in ttft, tpot, e2el; got {part!r}")
            try:
                slos[name] = float(value)
            except ValueError:
                raise ValueError(f"--goodput {part!r}: {value!r} is not a number of milliseconds") from None
            if slos[name] <= 0:
                raise ValueError(f"--goodput {part!r}: the SLO must be positive")
    return slos


def _stats(values_s: Sequence[float], name: str, percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1e3
    if ms.size == 0:
        ms = np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    """True when `r` completed within every SLO (ms); a missing TPOT (one token) meets a TPOT SLO."""
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[k] * 1e3 <= v for k, v in slos.items())


def compute_metrics(records: Sequence[RequestRecord], duration: float, slos: dict[str, float] | None = None,
                    percentiles: Sequence[float] = (99,)) -> dict[str, Any]:
    """vLLM's result dict: counts, throughputs, goodput, per-metric stats (ms) and per-request lists (s)."""
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    dur = max(duration, 1e-9)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    result: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur, "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "request_goodput": (sum(meets_slos(r, slos) for r in ok) / dur) if slos else None,
        "prefix_cache_hit_rate": (sum(cached) / max(1, sum(r.prompt_len for r in ok if r.cached_tokens is not None))
                                  if cached else None),
    }
    result.update(spec_decode_metrics(ok))
    series = {"ttft": [r.ttft for r in ok], "tpot": [t for r in ok if (t := r.tpot) is not None],
              "itl": [g for r in ok for g in r.itl], "e2el": [r.latency for r in ok]}
    for name in METRICS:
        result.update(_stats(series[name], name, percentiles))
    result.update({"input_lens": [r.prompt_len for r in records], "output_lens": [r.output_len for r in records],
                   "ttfts": [r.ttft for r in records], "itls": [r.itl for r in records],
                   "latencies": [r.latency for r in records], "errors": [r.error for r in records]})
    return result


def spec_decode_metrics(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """vLLM's speculative-decoding keys (acceptance rate = accepted / draft tokens, acceptance length = 1 +
    accepted per verify step); none when no request proposed."""
    steps = sum(r.spec_steps for r in records)
    drafts = sum(r.spec_draft_tokens for r in records)
    if not drafts:
        return {}
    accepted = sum(r.spec_accepted_tokens for r in records)
    return {"spec_decode_acceptance_rate": accepted / drafts, "spec_decode_acceptance_length": 1 + accepted / steps,
            "spec_decode_num_drafts": steps, "spec_decode_draft_tokens": drafts,
            "spec_decode_accepted_tokens": accepted}


def format_summary(result: dict[str, Any], percentiles: Sequence[float] = (99,)) -> str:
    """The summary block `vllm bench serve` prints."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        if value is None:
            return
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    if result.get("request_rate") is not None:
        row("Request rate configured (RPS):", result["request_rate"], ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    row("Request goodput (req/s):", result.get("request_goodput"), ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")
    if result.get("prefix_cache_hit_rate") is not None:
        row("Prefix cache hit rate (%):", 100 * result["prefix_cache_hit_rate"], ".2f")
    for name in METRICS:
        title, short = _TITLES[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", result.get(f"p{p:g}_{name}_ms"), ".2f")
    if result.get("spec_decode_draft_tokens"):
        lines.append("{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"))
        row("Acceptance rate (%):", 100 * result["spec_decode_acceptance_rate"], ".2f")
        row("Acceptance length:", result["spec_decode_acceptance_length"], ".2f")
        row("Drafts:", result["spec_decode_num_drafts"])
        row("Draft tokens:", result["spec_decode_draft_tokens"])
        row("Accepted tokens:", result["spec_decode_accepted_tokens"])
    lines.append("=" * 50)
    return "\n".join(lines)


def finite(x: Any) -> Any:
    """JSON-safe copy: inf/nan -> None, recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x
