"""Part `report` (issue 42 item 3): calibrate, then the measured-vs-predicted report, on synthetic-1b in bf16 and
with `--quantization fp8`, sized to the check's budget (`scripts/gpu_config.budget_report_config`).

Each run writes its report.json/.md and profile.json into OUT/report_<mode>/. Targets (the CPU's, issue 42): the
report's median |error| of TPOT <= 10% and TTFT <= 15%, and both chunked-prefill predictions within 20%. The fp8
run starts only when the time the bf16 run took is still left.
"""

from __future__ import annotations

import time

from jaxserve.measure.report.run import run_report
from scripts.gpu_config import budget_report_config
from scripts.gpu_parts.common import Part

MODES = (("bf16", None), ("fp8", "fp8"))


def one(part: Part, mode: str, quantization: str | None) -> dict:
    cfg = budget_report_config(part.sizes.model, part.sizes.dtype, quantization, smoke=part.smoke)
    t = time.perf_counter()
    report = run_report(cfg, part.out / f"report_{mode}", log=lambda m: part.log(f"{mode}: {m}"))
    s = report["summary"]
    return {"seconds": time.perf_counter() - t, "calibration": report.get("calibration"),
            "median_abs_error_tpot_pct": s["median_abs_error_tpot_pct"],
            "median_abs_error_ttft_pct": s["median_abs_error_ttft_pct"], "grid": s["grid"], "load": s["load"],
            "chunked_prefill": s.get("chunked_prefill"), "met": s["met"], "machine_steady": s.get("machine_steady")}


def main() -> None:
    part = Part("report", __doc__.splitlines()[0], 100)
    need = 10.0
    for mode, quantization in MODES[: part.sizes.report_modes]:
        r = part.run(f"report {mode}", lambda m=mode, q=quantization: one(part, m, q), need_s=need)
        if r is None:
            continue
        need = 0.9 * r["seconds"]
        cp = r["chunked_prefill"] or {}
        part.figure(f"report {mode}: median |TPOT error|", r["median_abs_error_tpot_pct"], "%", "<=", 10, "42")
        part.figure(f"report {mode}: median |TTFT error|", r["median_abs_error_ttft_pct"], "%", "<=", 15, "42")
        for key, what in (("chunked_p99_error_pct", "chunked p99 ITL"), ("unchunked_max_error_pct",
                                                                          "unchunked max ITL")):
            value = cp.get(key)
            part.figure(f"report {mode}: |{what} prediction error|", None if value is None else abs(value), "%",
                        "<=", 20, "42")
    part.finish()


if __name__ == "__main__":
    main()
