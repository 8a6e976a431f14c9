"""sarathi_rt: a Sarathi-Serve style LLM inference runtime with a C++/CUDA core.

The package root is cheap to import: `LLM`, `SamplingParams`, `ops` and the native core
load on first use, so embedding only the scheduler, simulator or workloads never pulls
in torch."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sarathi_rt import ops
    from sarathi_rt.llm import LLM
    from sarathi_rt.sampling import SamplingParams

# Public name -> module that defines it, imported on first attribute access.
_LAZY = {"LLM": "sarathi_rt.llm", "SamplingParams": "sarathi_rt.sampling"}
_LAZY_MODULES = {"ops"}


def build_info() -> dict[str, Any]:
    """How the native core was built: version, cuda_compiled, cuda_archs, openmp, cutlass_version."""
    from sarathi_rt import _C

    return dict(_C.build_info())


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(f"sarathi_rt.{name}")
    elif name == "__version__":  # stamped into the core by the build, so it names what runs
        value = str(build_info()["version"])
    else:
        raise AttributeError(f"module 'sarathi_rt' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = ["LLM", "SamplingParams", "build_info", "ops", "__version__"]
