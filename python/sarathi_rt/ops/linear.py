"""Linear layers: y = x @ weight.T + bias.

On the CPU this is torch's own GEMM (oneDNN/MKL): a documented choice, since no
hand-written CPU GEMM of ours would beat it and the runtime's CPU target is correctness
and the step-time staircase, not peak FLOP/s.
"""
from __future__ import annotations

import torch

from sarathi_rt.ops._checks import DTYPE_CODES, check_same, check_tensor

_FLOATS = tuple(DTYPE_CODES)


def _check_linear_args(x: object, weight: object, bias: object) -> None:
    check_tensor("x", x, dtypes=_FLOATS)
    check_tensor("weight", weight, ndim=2, dtypes=_FLOATS)
    check_same("weight", weight, "x", x)
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dimension must equal weight's in_features {weight.shape[1]}, "
                         f"got x of shape {tuple(x.shape)}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=_FLOATS)
        check_same("bias", bias, "x", x)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias has {bias.shape[0]} entries but weight has {weight.shape[0]} out_features")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N], accumulating in float32."""
    _check_linear_args(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
