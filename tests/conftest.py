"""Shared test helpers: tolerances, the CUDA marker with its skip, and the CPU's BF16
flags pinned (see `cpu_without_bf16`)."""
from __future__ import annotations

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


@pytest.fixture(autouse=True)
def cpu_without_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs as on a CPU without native BF16 (CI's), so an engine given no dtype
    computes in float32 on any machine, as the float32 references expect; the tests of
    the dtype rule fake the flags they need. SARATHI_RT_CPU_BF16 from the shell is dropped."""
    import sarathi_rt.engine.config

    monkeypatch.setattr(sarathi_rt.engine.config, "cpu_flags", lambda: set())
    monkeypatch.delenv("SARATHI_RT_CPU_BF16", raising=False)


@pytest.fixture
def emulated_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit bfloat16 runs in bf16 on this CPU (SARATHI_RT_CPU_BF16=emulate), as the
    tests of the bf16 path need on a CPU without BF16."""
    monkeypatch.setenv("SARATHI_RT_CPU_BF16", "emulate")
