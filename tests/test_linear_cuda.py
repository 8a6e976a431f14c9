"""The CUTLASS linear GEMM on the GPU against a float32 torch reference (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from sarathi_rt import ops

from conftest import requires_cuda

pytestmark = requires_cuda

DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
CONFIGS = ops.gemm_tile_configs()


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).cuda()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).cuda()
    b = torch.randn(n, generator=g).to(dtype).cuda()
    return x, w, b


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ w.float().T
    return out if b is None else out + b.float()


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out.float(), ref, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 16, 64, 65, 128, 257, 1000])
@pytest.mark.parametrize("n,k", [(6144, 4096), (512, 1536), (136, 72)])
def test_linear_matches_float32_reference(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    x, w, b = _operands(m, n, k, dtype)
    plan = ops.gemm_plan(m, n, k, dtype, "cuda")
    assert plan.swap_ab == (m <= 64)
    _close(ops.linear(x, w), _reference(x, w, None), dtype)
    _close(ops.linear(x, w, b), _reference(x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [c["id"] for c in CONFIGS])
@pytest.mark.parametrize("split_k", [1, 3])
def test_every_tile_config_and_split(dtype: torch.dtype, config: int, split_k: int) -> None:
    m, n, k = 200, 264, 1024
    x, w, b = _operands(m, n, k, dtype, seed=config)
    name = next(c["name"] for c in CONFIGS if c["id"] == config)
    plan = ops.gemm_plan(m, n, k, dtype, "cuda", config=name, split_k=split_k)
    workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device="cuda")
    for bias in (None, b):
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        torch.ops.sarathi_rt.linear_out(x, w, bias, out, config, split_k, workspace)
        _close(out, _reference(x, w, bias), dtype)


def test_linear_takes_batched_and_row_strided_x() -> None:
    x, w, b = _operands(24, 256, 128, torch.bfloat16)
    batched = x.view(2, 12, 128)
    assert ops.linear(batched, w, b).shape == (2, 12, 256)
    _close(ops.linear(batched, w, b).view(24, 256), _reference(x, w, b), torch.bfloat16)
    wide = torch.randn(24, 256, device="cuda").to(torch.bfloat16)
    strided = wide[:, :128]  # rows 256 elements apart
    _close(ops.linear(strided, w), _reference(strided, w, None), torch.bfloat16)


def test_unaligned_shapes_and_float32_fall_back_to_torch() -> None:
    x, w, b = _operands(10, 30, 20, torch.float16)  # N and K not multiples of 8
    _close(ops.linear(x, w, b), _reference(x, w, b), torch.float16)
    x32, w32 = torch.randn(5, 64, device="cuda"), torch.randn(32, 64, device="cuda")
    torch.testing.assert_close(ops.linear(x32, w32), x32 @ w32.T)
    assert ops.linear(torch.empty(0, 64, device="cuda", dtype=torch.float16), w32.half()).shape == (0, 32)


def test_linear_bad_inputs_on_cuda_name_the_argument() -> None:
    x, w, _ = _operands(4, 64, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="weight is on"):
        ops.linear(x, w.cpu())
    with pytest.raises(TypeError, match="weight has dtype"):
        ops.linear(x, w.half())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [4, 200])
def test_split_k_sums_in_float32_like_the_unsplit_gemm(dtype: torch.dtype, m: int) -> None:
    # Rounding each K slice's partial sum to 16 bits would move outputs by several ulps
    # over 8 slices; summing in float32 leaves the one final rounding of the unsplit GEMM.
    n, k = 256, 14336
    x, w, b = _operands(m, n, k, dtype, seed=5)
    config = ops.gemm_plan(m, n, k, dtype, "cuda").config
    outs = {}
    for split_k in (1, 8):
        plan = ops.gemm_plan(m, n, k, dtype, "cuda", config=config, split_k=split_k)
        workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device="cuda")
        outs[split_k] = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        torch.ops.sarathi_rt.linear_out(x, w, b, outs[split_k], plan.config_id, split_k, workspace)
    ulp = outs[1].float().abs() * torch.finfo(dtype).eps
    assert torch.all((outs[8].float() - outs[1].float()).abs() <= ulp + 1e-6)
    _close(outs[8], _reference(x, w, b), dtype)


def test_split_k_needs_its_workspace() -> None:
    x, w, _ = _operands(16, 256, 4096, torch.bfloat16)
    out = torch.empty(16, 256, dtype=torch.bfloat16, device="cuda")
    small = torch.empty(64, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="workspace"):
        torch.ops.sarathi_rt.linear_out(x, w, None, out, 4, 4, small)
