"""Shared test helpers: building paged batches and the CUDA skip marker."""
from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none present)")

# What each storage dtype can be expected to reach against a float64 reference.
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
