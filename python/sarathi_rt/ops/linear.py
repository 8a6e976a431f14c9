"""Linear layers: y = x @ weight.T + bias.

On CUDA, bfloat16/float16 run a CUTLASS tensor-core GEMM (float32 accumulation) with the
tile configuration and split-K that `gemm_plan` chooses for (M, N, K, SMs), so the
runtime knows the tile its steps are aligned to. Split-K adds its K slices up in float32
too and rounds once, so it agrees with the unsplit GEMM to the output dtype's rounding.
float32, and shapes the 16-byte vectorized kernels cannot take (K or N not a multiple of
8, misaligned views), go to torch. On the CPU this is torch's own GEMM (oneDNN/MKL), which a hand-written one of ours
would not beat, except in one case that decode steps hit every time: a few rows against
a weight too large to stay in cache (the LM head). That product is bound by reading the
weight, which torch's GEMM does at a fraction of memory bandwidth; our kernel streams it
once (bench/RESULTS.md has the comparison).

On the CPU every row's result is independent of the other rows in the call (batch
invariance), so a token's activations, KV and logits do not depend on what else shares
its step: prefix caching and any chunking give bit-identical outputs (see the README).
oneDNN/MKL choose their kernel, and with it the order of the K reduction, by the row
count and the thread split; with the rows padded to a multiple of 16 they always run
the same blocked kernel (tests/test_linear_cpu.py checks it). Streamed weights run our
kernel, whose per-row reduction order is fixed, in one call that reads the weight once
per tile of rows that fits in L2 (csrc/cpu/gemm_streamed.cpp).
"""
from __future__ import annotations

from typing import Any

import torch

from sarathi_rt import _C
from sarathi_rt.ops._checks import DTYPE_CODES, check_same, check_tensor, device_code, stream_of
from sarathi_rt.ops._registry import KERNELS, native_op
from sarathi_rt.ops.gemm_plan import gemm_plan

_FLOATS = tuple(DTYPE_CODES)
_ALIGN = 8  # elements per 16-byte vector of a 16-bit dtype


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


# Weights from this size on are read from memory on every call (past the caches).
_STREAMED_WEIGHT_BYTES = 16 << 20
_CPU_ROW_TILE = 16


def _streams_weight(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    operands = (x2, weight) + (() if bias is None else (bias,))
    return (x2.shape[0] > 0 and all(t.stride(-1) == 1 for t in operands)
            and weight.numel() * weight.element_size() >= _STREAMED_WEIGHT_BYTES)


def _cutlass_can_run(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    operands = [x2, weight] + ([] if bias is None else [bias])
    return (x2.dtype in (torch.float16, torch.bfloat16) and x2.shape[1] % _ALIGN == 0
            and weight.shape[0] % _ALIGN == 0 and all(t.stride(-1) == 1 for t in operands)
            and x2.stride(0) % _ALIGN == 0 and weight.stride(0) % _ALIGN == 0
            and all(t.data_ptr() % 16 == 0 for t in operands))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N], accumulating in float32."""
    _check_linear_args(x, weight, bias)
    return apply_linear(x, weight, bias, kernels=torch.ops.sarathi_rt)


def apply_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 kernels: Any = KERNELS) -> torch.Tensor:
    """`linear` without its argument checks, for the model's layers: their weights'
    shapes, dtype and device are fixed when the model is built, and the activations are
    the previous layer's output. `linear` launches through the dispatcher
    (kernels=torch.ops.sarathi_rt), the layers without it."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x.device.type == "cpu":
        return _cpu_linear(x2, weight, bias, kernels).view(*x.shape[:-1], n)
    if x2.shape[0] == 0 or not _cutlass_can_run(x2, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)
    plan = gemm_plan(x2.shape[0], n, k, x.dtype, x.device)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    # Split-K: the float32 sum of the K slices and one semaphore per output tile.
    workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=x.device)
    kernels.linear_out(x2, weight, bias, out, plan.config_id, plan.split_k, workspace)
    return out.view(*x.shape[:-1], n)


def _cpu_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: Any) -> torch.Tensor:
    """Batch-invariant CPU product (see the module docstring)."""
    m, n = x2.shape[0], weight.shape[0]
    if _streams_weight(x2, weight, bias):
        out = torch.empty(m, n, dtype=x2.dtype)
        kernels.linear_out(x2, weight, bias, out, 0, 1, torch.empty(0, dtype=torch.uint8))
        return out
    pad = -m % _CPU_ROW_TILE
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    out = torch.nn.functional.linear(x2, weight, bias)
    return out[:m] if pad else out


@native_op("linear_out", mutates_args=("out", "workspace"))
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, config: int,
               split_k: int, workspace: torch.Tensor) -> None:
    _C.gemm(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
            weight.shape[0], x.shape[1], (x.stride(0), weight.stride(0), out.stride(0)), DTYPE_CODES[x.dtype],
            config, split_k, workspace.data_ptr(), workspace.numel(), device_code(x), stream_of(x))

