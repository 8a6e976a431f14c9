"""Linear layers: y = x @ weight.T + bias.

On CUDA, bfloat16/float16 run a CUTLASS tensor-core GEMM (float32 accumulation) with the
tile configuration and split-K that `gemm_plan` chooses for (M, N, K, SMs), so the
runtime knows the tile its steps are aligned to. Split-K adds its K slices up in float32
too and rounds once, so it agrees with the unsplit GEMM to the output dtype's rounding.
float32, and shapes the 16-byte vectorized kernels cannot take (K or N not a multiple of
8, misaligned views), go to torch. On the CPU it is torch's own GEMM (oneDNN/MKL) or our
streamed kernel, by the rule below: decode steps multiply a few rows by each weight, a
product bound by reading the weight, which torch's GEMM does at a fraction of memory
bandwidth on rows padded to 16, where ours streams it once (bench/RESULTS.md).

On the CPU every row's result is independent of the other rows in the call (batch
invariance), so a token's activations, KV and logits do not depend on what else shares
its step: prefix caching and any chunking give bit-identical outputs (see the README).
oneDNN/MKL choose their kernel, and with it the order of the K reduction, by the row
count and the thread split; with the rows padded to a multiple of 16 they always run
the same blocked kernel (tests/test_linear_cpu.py checks it). Our kernel
(csrc/cpu/gemm_streamed.cpp) has one per-row reduction order at any row count and reads
the weight once per tile of rows that fits in L2, with no padding.

Which of the two a weight runs depends on the weight (dtype, size) and the CPU, never on
the row count: a weight's kernel runs its decodes and its prefill chunks alike, so it
must win at 1-16 rows and stay close at 512 (bench/bench_gemm_small.py; RESULTS.md,
"CPU GEMMs at small batch"):

- float32 on an AMD CPU with AVX2 or AVX-512: ours for every weight. torch's float32
  GEMM is MKL's, which on AMD read SmolLM2's projections at a third to a half of the
  bandwidth ours does at 1-4 rows and was still 1.45x slower than ours at 512 rows (one
  thread, AVX-512; AVX2 in RESULTS.md). On Intel, where MKL is at home, this is
  unmeasured and torch keeps the weights under 16 MiB.
- bfloat16 at the avx512_bf16 level (AVX512-BF16 without AMX): ours for every weight.
  It multiplies bf16 pairs with vdpbf16ps; with each thread given an equal share of w
  and each 4 x 4 block's sums rounded and stored in vector code, it reads SmolLM2's
  projections 2-3x faster than oneDNN on rows padded to 16 at 1-16 rows and is within
  0.89-1.02x of its time at 512 rows at two threads (1.07-1.15x at one; RESULTS.md,
  "bf16 projections on our kernel").
- everything else: ours for weights of 16 MiB and more (read from memory on every call:
  the LM head), torch for the rest. With AMX, oneDNN's bf16 runs on tiles that compute
  several times what vdpbf16ps does, so prefill chunks would lose more on ours than
  decodes gain (not measured: no AMX host was at hand); emulated bf16 and float16 have
  no native pair product in ours.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from sarathi_rt import _C
from sarathi_rt.ops._checks import DTYPE_CODES, check_same, check_tensor, device_code, stream_of
from sarathi_rt.ops._registry import KERNELS, native_op
from sarathi_rt.ops.gemm_plan import gemm_plan
from sarathi_rt.utils.cpu import is_amd, isa_level, native_flags

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


def cpu_padded_rows(m: int) -> int:
    """The rows torch's GEMM runs an m-row CPU product on: m padded with zero rows to a
    multiple of 16, so oneDNN/MKL always pick the same blocked kernel (batch invariance).
    The layer loop (models/layer_loop.py) sizes its workspaces by it too."""
    return -(-m // _CPU_ROW_TILE) * _CPU_ROW_TILE


# The rule of the module docstring, fixed when the module loads: the ISA level is the
# process's (SARATHI_RT_CPU_ISA applies when the core loads, before this module); our
# kernel is vectorized at every level above base.
_OURS_FLOAT32 = is_amd() and _C.cpu_isa() != "base"
_OURS_BFLOAT16 = isa_level(native_flags()) == "avx512_bf16"


def _streams_weight(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether our kernel runs this product: by the weight and the CPU (any row count but
    none), and only on rows, weight and bias with contiguous last dimensions."""
    operands = (x2, weight) + (() if bias is None else (bias,))
    if x2.shape[0] == 0 or any(t.stride(-1) != 1 for t in operands):
        return False
    if (weight.dtype == torch.float32 and _OURS_FLOAT32) or (weight.dtype == torch.bfloat16 and _OURS_BFLOAT16):
        return True
    return weight.numel() * weight.element_size() >= _STREAMED_WEIGHT_BYTES


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
    rows = cpu_padded_rows(m)
    if rows > m:
        x2 = _PADDED.rows(x2, rows)
    out = torch.nn.functional.linear(x2, weight, bias)
    return out[:m] if rows > m else out


def bound_cpu_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   out: torch.Tensor) -> Callable[[int], None]:
    """Our CPU kernel writing x's first `rows` rows @ weight.T (+ bias) into out's, for
    buffers that outlive the calls (the layer loop's workspaces): the pointers, strides
    and dtype `_linear_op` reads per call are read once here (its views and reads cost
    ~5 us a call, 0.6 ms of a 1-row SmolLM2 step's 121 GEMMs). The same kernel call, so
    the same bits."""
    n, k = weight.shape
    x_at, w_at, y_at = x.data_ptr(), weight.data_ptr(), out.data_ptr()
    b_at = 0 if bias is None else bias.data_ptr()
    strides, dtype = (x.stride(0), weight.stride(0), out.stride(0)), DTYPE_CODES[x.dtype]
    device, stream = device_code(x), stream_of(x)
    return lambda rows: _C.gemm(x_at, w_at, b_at, y_at, rows, n, k, strides, dtype, 0, 1, 0, 0, device, stream)


class _PaddedRows(threading.local):
    """x's rows followed by zero rows, in a buffer kept per thread and per (K, dtype) and
    grown to the largest padded row count seen, so padding allocates nothing per call
    (`new_zeros` + `cat` cost two allocations a projection, 7 a layer). Per thread:
    torch's GEMM releases the GIL, and two threads must not share the rows."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def rows(self, x2: torch.Tensor, rows: int) -> torch.Tensor:
        """x2 [m, K] copied into the first m of `rows` rows, the rest zero (a view that the
        next call on this thread overwrites: use it before then)."""
        m, k = x2.shape
        key = (k, x2.dtype)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape[0] < rows:
            buffer = self.buffers[key] = torch.empty(rows, k, dtype=x2.dtype)
        padded = buffer[:rows]
        padded[:m].copy_(x2)
        padded[m:].zero_()
        return padded


_PADDED = _PaddedRows()


@native_op("linear_out", mutates_args=("out", "workspace"))
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, config: int,
               split_k: int, workspace: torch.Tensor) -> None:
    _C.gemm(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
            weight.shape[0], x.shape[1], (x.stride(0), weight.stride(0), out.stride(0)), DTYPE_CODES[x.dtype],
            config, split_k, workspace.data_ptr(), workspace.numel(), device_code(x), stream_of(x))

