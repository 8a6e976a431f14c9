"""NVTX ranges for nsys timelines, pushed through the C++ core's NVTX3 calls, so Python's
ranges and the core's share one domain, "sarathi_rt", and one thread stack. The engine's
phases (step, schedule, prepare, forward, sample, detokenize) are always marked; ranges
per layer (`layer{i}`, `logits`) and per core op (attention_plan, attention, write_kv, gemm) only
with SARATHI_RT_NVTX=detail, the one switch, read once at import by both sides. Without
a tool attached a range costs a call into the core; with a core built without the NVTX3
headers (_C.NVTX False) ranges are no-ops."""
from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext

from sarathi_rt import _C

_MODE = os.environ.get("SARATHI_RT_NVTX", "")
if _MODE not in ("", "phases", "detail"):
    raise ValueError(f"SARATHI_RT_NVTX must be 'phases' (the default) or 'detail', got {_MODE!r}")
DETAIL = _MODE == "detail"

# One color per phase keeps an nsys timeline readable at a glance (ARGB).
_COLORS = {"step": 0xFF808080, "schedule": 0xFF3060E0, "prepare": 0xFFE0C020, "forward": 0xFF30A040,
           "sample": 0xFF9040C0, "detokenize": 0xFFC03060, "layer": 0xFF20B0C0}


class _Range:
    __slots__ = ("name", "argb")

    def __init__(self, name: str, argb: int) -> None:
        self.name, self.argb = name, argb

    def __enter__(self) -> None:
        _C.nvtx_push(self.name, self.argb)

    def __exit__(self, *exc: object) -> None:
        _C.nvtx_pop()


def nvtx_range(name: str, phase: str | None = None) -> AbstractContextManager[object]:
    """`with nvtx_range("forward"):` marks a phase; `phase` picks its color."""
    if not _C.NVTX:
        return nullcontext()
    return _Range(name, _COLORS.get(phase or name, 0xFFA0A0A0))


def nvtx_detail_range(name: str, phase: str) -> AbstractContextManager[object]:
    """A range per layer or op: only with SARATHI_RT_NVTX=detail."""
    return nvtx_range(name, phase) if DETAIL else nullcontext()
