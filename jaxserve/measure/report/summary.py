"""The report's headline: median errors per metric and kind, the targets and whether they are met; and the
context check that runs before anything is measured."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.measure.report.chunked import check_long_prompt_fits
from jaxserve.measure.report.context import ReportConfig
from jaxserve.measure.report.disagg import summarize_disagg


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median absolute errors (%) over the grid and load rows, per metric and per kind, and the chunked targets."""

    def med(kinds: tuple[str, ...], key: str) -> float | None:
        errs = [abs(r[key]) for r in rows if r["kind"] in kinds and r.get(key) is not None]
        return float(np.median(errs)) if errs else None

    out: dict[str, Any] = {
        "median_abs_error_ttft_pct": med(("grid", "load"), "ttft_error_pct"),
        "median_abs_error_tpot_pct": med(("grid", "load"), "tpot_error_pct"),
        "median_abs_error_throughput_pct": med(("grid", "load"), "throughput_error_pct"),
        "grid": {"ttft": med(("grid",), "ttft_error_pct"), "tpot": med(("grid",), "tpot_error_pct")},
        "load": {"ttft": med(("load",), "ttft_error_pct"), "tpot": med(("load",), "tpot_error_pct")},
        "load_closed_form": {"ttft": med(("load",), "closed_form_ttft_error_pct"),
                             "tpot": med(("load",), "closed_form_tpot_error_pct")},
        "targets": {"tpot_pct": 10.0, "ttft_pct": 15.0, "chunked_p99_over_undisturbed": 2.0,
                    "unchunked_stall_over_undisturbed": 5.0, "chunked_prediction_pct": 20.0},
    }
    chunked = {r["config"]["mode"]: r for r in rows if r["kind"] == "chunked-prefill"}
    if "chunked" in chunked and "unchunked" in chunked:
        c, u = chunked["chunked"], chunked["unchunked"]
        out["chunked_prefill"] = {
            "chunk_step_budget": c["config"]["step_budget"],
            "measured_p99_over_undisturbed": c["measured_p99_over_undisturbed"],
            "predicted_p99_over_undisturbed": c["predicted_p99_over_undisturbed"],
            "measured_unchunked_max_over_undisturbed": u["measured_max_over_undisturbed"],
            "predicted_unchunked_max_over_undisturbed": u["predicted_max_over_undisturbed"],
            "chunked_p99_error_pct": c["p99_itl_error_pct"], "unchunked_max_error_pct": u["max_itl_error_pct"]}
    if (disagg := summarize_disagg(rows)) is not None:
        out["disagg"] = disagg
    t = out["targets"]
    out["met"] = {
        "tpot": out["median_abs_error_tpot_pct"] is not None and out["median_abs_error_tpot_pct"] <= t["tpot_pct"],
        "ttft": out["median_abs_error_ttft_pct"] is not None and out["median_abs_error_ttft_pct"] <= t["ttft_pct"]}
    if "chunked_prefill" in out:
        cp = out["chunked_prefill"]
        out["met"].update({
            "chunked_p99": cp["measured_p99_over_undisturbed"] <= t["chunked_p99_over_undisturbed"],
            "unchunked_stall": cp["measured_unchunked_max_over_undisturbed"] >= t["unchunked_stall_over_undisturbed"],
            "chunked_prediction": all(e is not None and abs(e) <= t["chunked_prediction_pct"]
                                      for e in (cp["chunked_p99_error_pct"], cp["unchunked_max_error_pct"]))})
    return out


def check_context(cfg: ReportConfig, max_model_len: int, page_size: int) -> None:
    """Raise ValueError, before calibrating or measuring anything, if a grid point, a load or the long prompt
    needs more context than the engine has (the run would otherwise lose its requests minutes in)."""
    for what, tokens in ((f"the grid's {max(cfg.context_lens)}-token context", max(cfg.context_lens)
                          + cfg.grid_output_len), ("the loads' requests", cfg.load_input_len + cfg.load_output_len)):
        if tokens > max_model_len:
            raise ValueError(f"{what} and its outputs need {tokens} tokens but the model's max_model_len is "
                             f"{max_model_len}")
    check_long_prompt_fits(cfg, max_model_len, page_size)
