"""Prints the one summary table of bench/device_check.sh from the JSON lines every GPU
benchmark appended (keys: bench, case, metric, value, unit, baseline, baseline_value,
ratio, target)."""
from __future__ import annotations

import json
import sys

COLUMNS = ("bench", "case", "metric", "value", "unit", "baseline", "baseline_value", "ratio", "target")


def main(path: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    cells = [[str(r.get(c, "")) for c in COLUMNS] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(COLUMNS)]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
    if not rows:
        print("(no benchmark rows: see the log above)")


if __name__ == "__main__":
    main(sys.argv[1])
