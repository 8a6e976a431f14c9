"""NVTX ranges for nsys timelines. A no-op when the `nvtx` package is absent, so the
engine can mark its phases unconditionally."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

try:
    import nvtx as _nvtx
except ImportError:  # nvtx is optional (the `bench` extra)
    _nvtx = None

# One color per phase keeps an nsys timeline readable at a glance.
_COLORS = {"schedule": "blue", "prepare": "yellow", "forward": "green", "sample": "purple", "layer": "cyan"}


def nvtx_range(name: str, phase: str | None = None) -> AbstractContextManager[object]:
    """`with nvtx_range("forward"):` marks a phase; `phase` picks its color."""
    if _nvtx is None:
        return nullcontext()
    return _nvtx.annotate(name, color=_COLORS.get(phase or name, "gray"), domain="sarathi_rt")
