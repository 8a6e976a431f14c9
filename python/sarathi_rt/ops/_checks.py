"""Argument checks shared by the op wrappers: every failure names the argument."""
from __future__ import annotations

from typing import Sequence

import torch

# Storage dtypes the kernels support, with the code the C++ core uses for each.
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
CPU = -1


def check_tensor(name: str, t: object, *, ndim: int | None = None, dtypes: Sequence[torch.dtype] | None = None,
                 contiguous: bool = False, last_dim_contiguous: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}, got {str(t.dtype).removeprefix('torch.')}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    return t


def check_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, *, shape: bool = False) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
    if t.dtype != ref.dtype and t.is_floating_point() and ref.is_floating_point():
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}")
    if shape and t.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}")


def device_code(t: torch.Tensor) -> int:
    if t.device.type == "cpu":
        return CPU
    if t.device.type == "cuda":
        return t.device.index if t.device.index is not None else torch.cuda.current_device()
    raise ValueError(f"unsupported device {t.device}: sarathi_rt ops run on cpu and cuda tensors")


def stream_of(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.device.type == "cuda" else 0
