"""Import time of the torch-free modules in fresh interpreters (target: < 150 ms each
above a bare interpreter), and of the package root plus `LLM` for contrast.

    PYTHONPATH=python python3 bench/bench_import.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

MODULES = ["sarathi_rt", "sarathi_rt.scheduler", "sarathi_rt.sim", "sarathi_rt.workloads"]
PROBE = """import time, sys, json
t = time.perf_counter()
{code}
dt = time.perf_counter() - t
print(json.dumps([dt, 'torch' in sys.modules, 'matplotlib' in sys.modules]))"""


def measure(code: str, repeats: int) -> tuple[float, bool, bool]:
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", PROBE.format(code=code)], check=True, capture_output=True,
                             text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    return statistics.median(r[0] for r in runs), runs[0][1], runs[0][2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path (quick lane)")
    args = parser.parse_args()
    if args.smoke:
        args.repeats = 1
    cases = [(m, f"import {m}") for m in MODULES] + [("sarathi_rt.LLM", "import sarathi_rt; sarathi_rt.LLM")]
    print(f"{'import':<22} {'median ms':>10} {'torch':>6} {'matplotlib':>10}   (median of {args.repeats})")
    for name, code in cases:
        seconds, torch_loaded, mpl_loaded = measure(code, args.repeats)
        print(f"{name:<22} {seconds * 1e3:>10.1f} {str(torch_loaded):>6} {str(mpl_loaded):>10}")


if __name__ == "__main__":
    main()
