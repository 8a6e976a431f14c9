"""Shared test helpers: tolerances, the CUDA marker with its skip, and the CPU's BF16
flags pinned (see `cpu_without_bf16`)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

# CUDA-only tests carry the declared `cuda` marker (so `-m "not cuda"` deselects them) and
# are skipped, by the hook below, on a machine without a device.
requires_cuda = pytest.mark.cuda


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none present)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)

# What each storage dtype can be expected to reach against a float64 reference.
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True, scope="session")
def cpu_without_bf16() -> Iterator[None]:
    """Every test runs as on a CPU without native BF16 (the AVX2 host kind's dtype rule),
    so an engine given no dtype computes in float32 on any machine, as the float32
    references expect. Through SARATHI_RT_CPU_ISA, capped below the bf16 levels (avx512 on
    an AVX-512 host: the kernels keep their width), so engines built by module fixtures
    and by subprocesses see it too. A lower level from the shell is kept:
    `SARATHI_RT_CPU_ISA=avx2 bash scripts/test.sh` runs the kernels as an AVX2 host does.
    The tests of the dtype rule, and tests/test_host_kinds.py, fake the flags they need.
    SARATHI_RT_CPU_BF16 from the shell is dropped."""
    from sarathi_rt.utils.cpu import BF16_ENV, ISA_ENV, ISA_LEVELS, cpu_flags, native_isa

    levels = list(ISA_LEVELS)
    level = levels[min(levels.index(native_isa(cpu_flags())), levels.index("avx512"))]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ISA_ENV, level)
        patch.delenv(BF16_ENV, raising=False)
        yield


@pytest.fixture
def emulated_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit bfloat16 runs in bf16 on this CPU (SARATHI_RT_CPU_BF16=emulate), as the
    tests of the bf16 path need on a CPU without BF16."""
    monkeypatch.setenv("SARATHI_RT_CPU_BF16", "emulate")
