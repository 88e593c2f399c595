"""Render a report dict (see `jaxserve.measure.report.run`) as markdown tables and a three-panel PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxserve.measure.report.context import fmt, fmt_pct
from jaxserve.measure.report.disagg import markdown as disagg_markdown
from jaxserve.measure.report.probe import drift_note, probe_markdown
from jaxserve.measure.report.speculative import markdown as speculative_markdown


def write_markdown(report: dict[str, Any], path: str | Path) -> None:
    """report.md: summary, then one table per kind of row."""
    s = report["summary"]
    rows = report["rows"]
    lines = [f"# jaxserve report: {report['model']} ({report['dtype']}) on {report['hardware']}", "",
             f"{report['date']}, {report['seconds']:.0f} s; engine step budget {report['engine']['step_budget']} "
             f"tokens, max_num_seqs {report['engine']['max_num_seqs']}; attention backend "
             f"{report['engine'].get('attention_backend')}.", ""]
    if report["engine"].get("cpu_kernels"):
        lines += [f"{report['engine']['cpu_kernels']}.", ""]
    cal = report.get("calibration")
    if cal:
        lines += [f"Calibrated in {cal['seconds']:.0f} s over {cal['samples']} engine steps "
                  f"(step fit median |error| {100 * cal['median_abs_error']:.1f}%), profile `{cal['profile']}`.", ""]
    lcf = s.get("load_closed_form") or {}
    lines += ["## Summary", "", "| metric | median abs error | target | met |", "|---|---|---|---|",
              f"| TPOT (grid + loads) | {fmt(s['median_abs_error_tpot_pct'])}% | <= 10% | {s['met']['tpot']} |",
              f"| TTFT (grid + loads) | {fmt(s['median_abs_error_ttft_pct'])}% | <= 15% | {s['met']['ttft']} |",
              f"| throughput | {fmt(s['median_abs_error_throughput_pct'])}% | | |",
              f"| loads only (simulator on the run's arrival trace): TTFT / TPOT | {fmt(s['load']['ttft'])}% / "
              f"{fmt(s['load']['tpot'])}% | | |",
              f"| loads only, closed form (steady state): TTFT / TPOT | {fmt(lcf.get('ttft'))}% / "
              f"{fmt(lcf.get('tpot'))}% | | |",
              f"| grid only: TTFT / TPOT | {fmt(s['grid']['ttft'])}% / {fmt(s['grid']['tpot'])}% | | |", ""]
    cp = s.get("chunked_prefill")
    if cp:
        lines += [f"Chunked prefill (planner chunk: step budget {cp['chunk_step_budget']}): p99 ITL / undisturbed "
                  f"TPOT measured {fmt(cp['measured_p99_over_undisturbed'], '.2f')}x (predicted "
                  f"{fmt(cp['predicted_p99_over_undisturbed'], '.2f')}x, target <= 2x: {s['met']['chunked_p99']}); "
                  f"unchunked stall {fmt(cp['measured_unchunked_max_over_undisturbed'])}x (predicted "
                  f"{fmt(cp['predicted_unchunked_max_over_undisturbed'])}x, target >= 5x: "
                  f"{s['met']['unchunked_stall']})"
                  f"; predictions within 20%: {s['met']['chunked_prediction']}.", ""]
    if md := s.get("machine_drift"):
        lines += ["Machine drift over the run (largest / smallest measured-over-predicted ratio of the reference "
                  "steps): " + ", ".join(f"{k} {v:.2f}x" for k, v in md.items()) + ".", ""]
        if note := drift_note(md):
            lines += [f"**{note}**", ""]
    lines += ["## Static grid", "", "| batch | context | TTFT pred | TTFT meas | err | TPOT pred | TPOT meas | err "
              "| tok/s pred | tok/s meas | err |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "grid":
            c = r["config"]
            lines.append(f"| {c['batch_size']} | {c['context_len']} | {fmt(r['predicted_ttft_ms'])} | "
                         f"{fmt(r['measured_ttft_ms'])} | {fmt_pct(r['ttft_error_pct'])} | "
                         f"{fmt(r['predicted_tpot_ms'], '.2f')} | {fmt(r['measured_tpot_ms'], '.2f')} | "
                         f"{fmt_pct(r['tpot_error_pct'])} | "
                         f"{fmt(r['predicted_throughput'])} | {fmt(r['measured_throughput'])} | "
                         f"{fmt_pct(r['throughput_error_pct'])} |")
    lines += ["", "## Online loads (Poisson)", "",
              "| load | req/s | TTFT pred | TTFT closed form | TTFT meas | err | TPOT pred | TPOT closed form "
              "| TPOT meas | err "
              "| tok/s pred | tok/s meas |", "|" + "---|" * 12]
    for r in rows:
        if r["kind"] == "load":
            c = r["config"]
            lines.append(f"| {c['load_fraction']:.0%} | {c['request_rate']:.2f} | {fmt(r['predicted_ttft_ms'])} | "
                         f"{fmt(r.get('closed_form_ttft_ms'))} | {fmt(r['measured_ttft_ms'])} | "
                         f"{fmt_pct(r['ttft_error_pct'])}"
                         f" | {fmt(r['predicted_tpot_ms'], '.2f')} | {fmt(r.get('closed_form_tpot_ms'), '.2f')} | "
                         f"{fmt(r['measured_tpot_ms'], '.2f')} | {fmt_pct(r['tpot_error_pct'])} | "
                         f"{fmt(r['predicted_throughput'])} | {fmt(r['measured_throughput'])} |")
    for r in rows:
        if r["kind"] == "load" and r.get("measured_steps"):
            lines.append(f"\nAt {r['config']['load_fraction']:.0%}: measured / predicted step time, median over "
                         f"{r['measured_steps']} steps: decode-only "
                         f"{fmt(r.get('measured_over_predicted_decode_step'), '.2f')}, with prefill "
                         f"{fmt(r.get('measured_over_predicted_prefill_step'), '.2f')}; mean decode batch "
                         f"{fmt(r.get('measured_decode_batch'))} (predicted {fmt(r.get('predicted_decode_batch'))}, "
                         f"closed form "
                         f"{fmt(r.get('closed_form_decode_batch'))}).")
    lines += ["", "## Chunked prefill (decodes running while a long prompt arrives)", "",
              "| mode | step budget | prefill/step | undisturbed pred | meas | p99 ITL pred | meas | max ITL pred "
              "| meas | long TTFT pred | meas |", "|" + "---|" * 11]
    for r in rows:
        if r["kind"] == "chunked-prefill":
            c = r["config"]
            lines.append(f"| {c['mode']} | {c['step_budget']} | {c['prefill_tokens_per_step']} | "
                         f"{fmt(r['predicted_undisturbed_itl_ms'])} | {fmt(r['measured_undisturbed_itl_ms'])} | "
                         f"{fmt(r['predicted_p99_itl_ms'])} | {fmt(r['measured_p99_itl_ms'])} | "
                         f"{fmt(r['predicted_max_itl_ms'])} | {fmt(r['measured_max_itl_ms'])} | "
                         f"{fmt(r['predicted_ttft_ms'])} | {fmt(r['measured_ttft_ms'])} |")

    lines += [""] + disagg_markdown(report) + speculative_markdown(report) + probe_markdown(report)
    lines += ["Errors are (predicted - measured) / measured. Grid predictions: the planner's discrete-event "
              "simulator of the same static batch; loads: the simulator on the engine's own arrival trace (a short run "
              "from an empty engine is a transient), the closed form's steady state beside it.", ""]
    Path(path).write_text("\n".join(lines))


def write_plot(report: dict[str, Any], path: str | Path) -> None:
    """report.png: TPOT vs batch size per context; TTFT vs load; decode ITLs beside a long prompt.

    Without matplotlib (a bare GPU image) the PNG is skipped; the JSON and markdown carry every number.
    """
    try:
        import matplotlib
    except ImportError:
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    grid = [r for r in rows if r["kind"] == "grid"]
    for k, ctx in enumerate(sorted({r["config"]["context_len"] for r in grid})):
        pts = sorted((r for r in grid if r["config"]["context_len"] == ctx), key=lambda r: r["config"]["batch_size"])
        b = [r["config"]["batch_size"] for r in pts]
        color = f"C{k}"
        ax.plot(b, [r["measured_tpot_ms"] for r in pts], "o-", color=color, label=f"measured, ctx {ctx}")
        ax.plot(b, [r["predicted_tpot_ms"] for r in pts], "x--", color=color, label=f"predicted, ctx {ctx}")
    sizes = sorted({r["config"]["batch_size"] for r in grid})
    ax.set(xscale="log", xlabel="batch size", ylabel="TPOT (ms)", title="Static batches: TPOT")
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    ax = axes[1]
    loads = sorted((r for r in rows if r["kind"] == "load"), key=lambda r: r["config"]["load_fraction"])
    x = [r["config"]["request_rate"] for r in loads]
    ax.plot(x, [r["measured_ttft_ms"] for r in loads], "o-", label="measured")
    ax.plot(x, [r["predicted_ttft_ms"] for r in loads], "x--", label="predicted (simulated trace)")
    ax.plot(x, [r.get("closed_form_ttft_ms") for r in loads], "s:", label="closed form (steady state)")
    ax.set(xlabel="request rate (req/s)", ylabel="mean TTFT (ms)", title="Online load: TTFT")
    ax.legend(fontsize=8)
    ax = axes[2]
    for k, r in enumerate(r for r in rows if r["kind"] == "chunked-prefill"):
        color = f"C{k}"
        mode, budget = r["config"]["mode"], r["config"]["step_budget"]
        ax.plot(r.get("measured_gaps_ms") or [], ".", color=color, ms=3, label=f"{mode} (budget {budget}) measured")
        if r.get("predicted_max_itl_ms") is not None:
            ax.axhline(r["predicted_max_itl_ms"], color=color, ls="--", lw=1, label=f"{mode} predicted max")
    ax.set(yscale="log", xlabel="decode gap (request-major order)", ylabel="ITL (ms)",
           title="Decodes beside a long prompt")
    ax.legend(fontsize=7)
    fig.suptitle(f"{report['model']} on {report['hardware']}: measured vs predicted")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
