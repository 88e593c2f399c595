"""Every prepared GPU check in one call: the parts of issues 41, 42 and 46, under 9 minutes on one H200.

    PYTHONUNBUFFERED=1 bash scripts/gpu_all.sh OUTDIR            # on the GPU (device tool: OUTDIR=$OUT/gpu)
    bash scripts/gpu_all.sh OUTDIR --smoke                        # the same parts on a CPU, tiny sizes
    bash scripts/gpu_all.sh OUTDIR --only step,b8                 # some parts

Each part (`scripts/gpu_parts/NAME.py`) runs as its own process with a budget of seconds; a part may also use what
earlier parts left unused, never what later parts are promised. Past that, its process group is killed and the
part reported as cut; its JSON (written after every measurement) still holds what it finished, and the next
part runs. Writes OUTDIR/NAME.json and NAME.log per part, OUTDIR/summary.json and OUTDIR/summary.md (every
figure against its issue's target), and prints each part's progress lines as they come.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# (part, issue, seconds on one H200; the smoke run's on a 2-core CPU) in the order they run: the decode step's
# figures first, the report (the longest, the most compiles) last, where it gets every second left over.
PARTS = (("step", "41", 100, 60), ("quantized", "42", 100, 60), ("prefill", "42", 45, 40), ("b8", "41", 70, 40),
         ("speculative", "46", 45, 40), ("quality", "42", 50, 90), ("report", "42", 110, 120))
TOTAL_S = {False: 535.0, True: 480.0}  # the device tool's call is 600 s; a part is cut before the whole is
GRACE_S = 8.0  # a part stops starting measurements this long before its hard limit, to write its record
OPTIONAL = ("tokenizers", "llguidance", "fastapi", "matplotlib")


def part_command(name: str, out: Path, allowed: float, smoke: bool) -> list[str]:
    cmd = [sys.executable, "-m", f"scripts.gpu_parts.{name}", str(out), "--budget-s", f"{allowed - GRACE_S:.0f}"]
    return cmd + (["--smoke"] if smoke else [])


def run_part(name: str, cmd: list[str], out: Path, allowed: float) -> dict[str, Any]:
    """Run one part's process for at most `allowed` seconds (then kill its process group: "cut"), its lines
    printed and kept in OUT/NAME.log; its record is what it wrote to OUT/NAME.json."""
    t = time.perf_counter()
    log = (out / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)

    def pump() -> None:
        for line in proc.stdout:
            log.write(line)
            if not line.startswith(("WARNING", "I0000", "W0000")):  # absl's start-up noise stays in the log
                print(line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=allowed)
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the part's own process group: the part and anything it started
        proc.wait()
        status = f"cut at its budget ({allowed:.0f} s)"
    reader.join(timeout=5)
    log.close()
    record_path = out / f"{name}.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    return {"status": status, "seconds": time.perf_counter() - t, "allowed_s": allowed, "record": record}


def summarize(results: dict[str, dict[str, Any]], args, elapsed: float, issues: dict[str, str],
              total: float) -> dict[str, Any]:
    """The summary: every part's status and every figure against its target."""
    device = next((r["record"].get("device") for r in results.values() if r.get("record", {}).get("device")), "?")
    jax_version = next((r["record"].get("jax") for r in results.values() if r.get("record", {}).get("jax")), "?")
    parts = {}
    for name, r in results.items():
        rec = r.get("record", {})
        parts[name] = {"issue": issues[name], "status": r["status"], "seconds": r.get("seconds", 0.0),
                       "allowed_s": r.get("allowed_s", 0.0), "measurements": len(rec.get("results", {})),
                       "figures": rec.get("figures", []), "errors": rec.get("errors", {}),
                       "skipped": rec.get("skipped", [])}
    figures = [f for p in parts.values() for f in p["figures"]]
    return {"device": device, "jax": jax_version, "smoke": args.smoke, "elapsed_s": elapsed,
            "total_budget_s": total, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "missing_optional_modules": [m for m in OPTIONAL if importlib.util.find_spec(m) is None],
            "parts": parts, "figures_met": sum(f["met"] is True for f in figures),
            "figures_missed": sum(f["met"] is False for f in figures),
            "figures_unmeasured": sum(f["value"] is None for f in figures)}


def _value(f: dict[str, Any]) -> str:
    v = f["value"]
    if v is None:
        return "not measured"
    return f"{v:.3g}{(' ' + f['unit']) if f['unit'] and f['unit'] != 'x' else ('x' if f['unit'] == 'x' else '')}"


def markdown(s: dict[str, Any]) -> str:
    lines = [f"# GPU check: {s['device']} (jax {s['jax']}), {s['date']}", "",
             f"{'CPU smoke run (tiny sizes): figures measure nothing. ' if s['smoke'] else ''}"
             f"Elapsed {s['elapsed_s']:.0f} s of {s['total_budget_s']:.0f}. Figures: {s['figures_met']} met, "
             f"{s['figures_missed']} missed, {s['figures_unmeasured']} not measured. Missing optional modules: "
             f"{', '.join(s['missing_optional_modules']) or 'none'}.", "",
             "| part | issue | status | seconds (allowed) | measurements | errors | skipped |",
             "|---|---|---|---:|---:|---:|---:|"]
    for name, p in s["parts"].items():
        lines.append(f"| {name} | {p['issue']} | {p['status']} | {p['seconds']:.0f} ({p['allowed_s']:.0f}) | "
                     f"{p['measurements']} | {len(p['errors'])} | {len(p['skipped'])} |")
    lines += ["", "## Figures against the issues' targets", "", "| part | figure | measured | target | met |",
              "|---|---|---:|---|---|"]
    for name, p in s["parts"].items():
        for f in p["figures"]:
            met = {True: "yes", False: "**no**", None: "-"}[f["met"]]
            lines.append(f"| {name} | {f['name']} (issue {f['issue']}) | {_value(f)} | {f['target']} | {met} |")
    notes = [f"- {name}: error in {k}: {v}" for name, p in s["parts"].items() for k, v in p["errors"].items()]
    notes += [f"- {name}: skipped {x}" for name, p in s["parts"].items() for x in p["skipped"]]
    if notes:
        lines += ["", "## Errors and skips", "", *notes]
    lines += ["", "Each part's measurements: OUTDIR/PART.json (traces under traces/, reports under report_*/); "
              "its full output: OUTDIR/PART.log."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on a CPU: the same parts and code")
    ap.add_argument("--only", default=None, help="comma-separated parts (default: all)")
    ap.add_argument("--total-s", type=float, default=None, help="the whole run's seconds (default: 535; smoke 480)")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    chosen = [p for p in PARTS if args.only is None or p[0] in args.only.split(",")]
    unknown = set(args.only.split(",")) - {p[0] for p in PARTS} if args.only else set()
    if unknown:
        sys.exit(f"error: unknown parts {', '.join(sorted(unknown))}; parts: {', '.join(p[0] for p in PARTS)}")
    t0 = time.perf_counter()
    total = args.total_s or TOTAL_S[args.smoke]
    deadline = t0 + total
    budgets = {name: smoke if args.smoke else gpu for name, _, gpu, smoke in chosen}
    results: dict[str, dict[str, Any]] = {}
    for i, (name, issue, _, _) in enumerate(chosen):
        allowed = deadline - time.perf_counter() - sum(budgets[n] for n, *_ in chosen[i + 1:])  # theirs kept
        print(f"[gpu_all {time.perf_counter() - t0:6.1f} s] part {name} (issue {issue}): {allowed:.0f} s",
              flush=True)
        if allowed < 2 * GRACE_S:
            results[name] = {"status": "not run: no time left", "record": {}}
            continue
        results[name] = run_part(name, part_command(name, out, allowed, args.smoke), out, allowed)
        print(f"[gpu_all {time.perf_counter() - t0:6.1f} s] part {name}: {results[name]['status']} in "
              f"{results[name]['seconds']:.0f} s", flush=True)
    summary = summarize(results, args, time.perf_counter() - t0, {n: i for n, i, *_ in chosen}, total)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    text = markdown(summary)
    (out / "summary.md").write_text(text)
    print(text, flush=True)
    print(f"[gpu_all {time.perf_counter() - t0:6.1f} s] wrote {out}/summary.md and summary.json", flush=True)


if __name__ == "__main__":
    main()
