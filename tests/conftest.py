"""Shared test helpers: tolerances and the CUDA marker with its skip."""
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
