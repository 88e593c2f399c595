"""Compare the planner's default-prior predictions with published engine measurements.

Usage: python scripts/validate_planner.py   (prints a markdown table and the median absolute errors)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.validate import compare_all, median_abs_errors, table  # noqa: E402


def main() -> int:
    rows = compare_all()
    print(table(rows))
    med = median_abs_errors(rows)
    n = {m: sum(r.metric == m for r in rows) for m in med}
    loop_rows = [r for r in rows if r.closed_loop]
    loop = median_abs_errors(loop_rows)
    nl = {m: sum(r.metric == m for r in loop_rows) for m in loop}
    print()
    print(f"median |error|: TPOT/ITL {med['tpot']:.1%} over {n['tpot']} points (target <= 25%), "
          f"TTFT {med['ttft']:.1%} over {n['ttft']} points (target <= 35%), "
          f"output throughput {med['throughput']:.1%} over {n['throughput']} points")
    print(f"closed-loop serving points: TTFT {loop['ttft']:.1%} over {nl['ttft']} (target <= 20%), "
          f"TPOT {loop['tpot']:.1%} over {nl['tpot']}, output throughput {loop['throughput']:.1%} over "
          f"{nl['throughput']}")
    floor = median_abs_errors(rows, roofline=True)
    print(f"pure roofline floor on the step-level points: median |error| TPOT {floor['tpot']:.1%}, "
          f"TTFT {floor['ttft']:.1%}")
    return 0 if med["tpot"] <= 0.25 and med["ttft"] <= 0.35 and loop["ttft"] <= 0.20 else 1


if __name__ == "__main__":
    sys.exit(main())
