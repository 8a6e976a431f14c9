"""A/B of two builds of this package on a shared machine: a bench script runs itself as a
child process once per side, in pairs that alternate which side goes first, so the
machine's drift (this VM's speed moves by up to 2x within minutes) lands on both sides.
Torch-free: it only starts processes and reads the JSON line each child prints last."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import sarathi_rt


def this_package() -> str:
    """The directory holding the sarathi_rt package this process imported."""
    return os.path.dirname(os.path.dirname(os.path.abspath(sarathi_rt.__file__)))


def run_pairs(script: str, args: list[str], baseline: str, pairs: int) -> dict[str, list[dict]]:
    """{"baseline": [...], "this": [...]}: the JSON of the last line each child of
    `python script *args` printed, with `baseline` (another checkout's python/ directory)
    or this package first on PYTHONPATH, in `pairs` alternating pairs."""
    child = [sys.executable, os.path.abspath(script), *args]
    runs: dict[str, list[dict]] = {"baseline": [], "this": []}
    for pair in range(pairs):
        for side in (("baseline", "this") if pair % 2 == 0 else ("this", "baseline")):
            path = baseline if side == "baseline" else this_package()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}
            out = subprocess.run(child, env=env, check=True, capture_output=True, text=True).stdout
            runs[side].append(json.loads(out.splitlines()[-1]))
    return runs
