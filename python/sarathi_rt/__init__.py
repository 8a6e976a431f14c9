"""sarathi_rt: a Sarathi-Serve style LLM inference runtime with a C++/CUDA core."""
from __future__ import annotations

from typing import Any

from sarathi_rt import _C
from sarathi_rt.llm import LLM
from sarathi_rt.sampling import SamplingParams

__version__: str = _C.build_info()["version"]


def build_info() -> dict[str, Any]:
    """How the native core was built: version, cuda_compiled, cuda_archs, openmp, cutlass_version."""
    return dict(_C.build_info())


__all__ = ["LLM", "SamplingParams", "build_info", "__version__"]
