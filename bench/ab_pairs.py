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
    return run_sides(script, {"baseline": (baseline, args), "this": (this_package(), args)}, pairs)


def run_sides(script: str, sides: dict[str, tuple[str, list[str]]], pairs: int) -> dict[str, list[dict]]:
    """{side: [...]} for two sides, each (package directory first on PYTHONPATH, the
    script's arguments): the JSON of the last line each child printed, in `pairs`
    pairs that alternate which side goes first."""
    first, second = sides
    runs: dict[str, list[dict]] = {first: [], second: []}
    for pair in range(pairs):
        for side in ((first, second) if pair % 2 == 0 else (second, first)):
            path, args = sides[side]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}
            out = subprocess.run([sys.executable, os.path.abspath(script), *args], env=env, check=True,
                                 capture_output=True, text=True).stdout
            runs[side].append(json.loads(out.splitlines()[-1]))
    return runs
