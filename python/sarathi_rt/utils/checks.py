"""The argument checks every layer repeats, written once. Each raises ValueError naming
the argument and the value it got, and returns the value so a check reads as an
assignment. torch-free (the scheduler, simulator and workloads use it)."""
from __future__ import annotations

import math


def positive_int(name: str, value: object) -> int:
    """An int > 0 (a bool is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def non_negative_int(name: str, value: object) -> int:
    """An int >= 0 (a bool is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def positive_number(name: str, value: object, unit: str = "") -> float:
    """A finite int or float > 0; `unit` ("seconds") is named in the message."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        what = f"a positive finite number of {unit}" if unit else "a positive finite number"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def fraction(name: str, value: object, *, closed_low: bool = True, closed_high: bool = False) -> float:
    """A number in [0, 1) by default; the bounds' closedness is the caller's."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and \
        (value >= 0 if closed_low else value > 0) and (value <= 1 if closed_high else value < 1)
    if not ok:
        interval = ("[" if closed_low else "(") + "0, 1" + ("]" if closed_high else ")")
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return float(value)


def boolean(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value
