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
    print()
    print(f"median |error|: TPOT/ITL {med['tpot']:.1%} over {n['tpot']} points (target <= 25%), "
          f"TTFT {med['ttft']:.1%} over {n['ttft']} points (target <= 35%)")
    floor = median_abs_errors(rows, roofline=True)
    print(f"pure roofline floor on the step-level points: median |error| TPOT {floor['tpot']:.1%}, "
          f"TTFT {floor['ttft']:.1%}")
    return 0 if med["tpot"] <= 0.25 and med["ttft"] <= 0.35 else 1


if __name__ == "__main__":
    sys.exit(main())
