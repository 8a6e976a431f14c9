"""One way to name a dtype anywhere in the public API: a torch dtype or its name
("float32", "float16", "bfloat16", also spelled "torch.bfloat16", "bf16", "fp16", "half",
"fp32", "float"). Every entry point that takes a dtype resolves it here."""
from __future__ import annotations

from typing import Sequence, Union

import torch

DTypeLike = Union[str, torch.dtype]

# What the kernels store and compute in (KV cache, activations, weights).
STORAGE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "double": torch.float64, "fp64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(dtype: DTypeLike, name: str = "dtype",
                allowed: Sequence[torch.dtype] = STORAGE_DTYPES) -> torch.dtype:
    """The torch dtype for `dtype` (a torch dtype or a name, case-insensitive). Raises
    ValueError for a string that names no dtype, TypeError for a dtype outside `allowed`
    or a value of another type; both messages name the argument `name`."""
    choices = ", ".join(dtype_name(d) for d in allowed[:-1]) + f" or {dtype_name(allowed[-1])}"
    if isinstance(dtype, str):
        resolved = _NAMES.get(dtype.strip().lower().removeprefix("torch."))
        if resolved is None:
            raise ValueError(f"{name} must be {choices} (a torch dtype or its name), got {dtype!r}")
    elif isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        raise TypeError(f"{name} must be {choices} (a torch dtype or its name), got {type(dtype).__name__}")
    if resolved not in allowed:
        raise TypeError(f"{name} must be {choices}, got {dtype_name(resolved)}")
    return resolved


def cuda_dtype(requested: str | None, capability: tuple[int, int]) -> str:
    """The dtype name a CUDA engine computes in, for a requested name (None: not given) on
    a GPU of compute `capability`: the CUDA attention kernel takes float16 and bfloat16
    only, so no dtype given means bfloat16 from SM 8.0 (Ampere, the first with bf16
    tensor cores) and float16 before; float32 is refused, naming the argument."""
    if requested is None:
        return "bfloat16" if capability >= (8, 0) else "float16"
    if requested not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be float16 or bfloat16 on CUDA (the attention kernel takes no other), "
                         f"got {requested!r}")
    return requested
