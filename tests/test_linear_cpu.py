"""ops.linear on the CPU: torch's GEMM, and our weight-streaming kernel for a few rows
against a large weight (the LM head of decode steps), both against float64."""
from __future__ import annotations

import pytest
import torch

from sarathi_rt import _C, ops

from conftest import ATOL

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def _kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The CPU kernel itself, whatever the shapes (ops.linear only sends it large weights)."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    torch.ops.sarathi_rt.linear_out(x, w, b, out, 0, 1, torch.empty(0, dtype=torch.uint8))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 7, 37), (5, 9, 16), (16, 33, 100), (3, 4, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float64_on_ragged_shapes(dtype: torch.dtype, m: int, n: int, k: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    x = (torch.randn(m, k, generator=g) / k ** 0.5).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    ref = _reference(x, w, b)
    out = _kernel(x, w, b)
    # One rounding of the float32 sum to the storage dtype, as torch's own GEMM does.
    torch_err = (torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype).double()
                 - ref).abs().max().item()
    assert out.dtype == dtype and out.shape == (m, n)
    assert (out.double() - ref).abs().max().item() <= 2 * torch_err + ATOL[dtype]


def test_kernel_takes_strided_rows_and_any_row_count() -> None:
    x = torch.randn(4, 80)[:, :64]  # rows 80 apart
    w = torch.randn(10, 64)
    assert torch.allclose(_kernel(x, w, None).double(), _reference(x, w, None), atol=1e-4)
    many = torch.randn(203, 64)  # past any register block, odd
    assert torch.allclose(_kernel(many, w, None).double(), _reference(many, w, None), atol=1e-4)
    assert _kernel(torch.randn(0, 64), w, None).shape == (0, 10)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 130])
def test_linear_on_a_vocab_sized_weight(rows: int) -> None:
    """8192 x 512 float32 is 16 MiB: the streaming kernel, in one call for any row count."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 512, generator=g)[1]  # a view, as the model's hidden states are
    w = torch.randn(8192, 512, generator=g) / 512 ** 0.5
    out = ops.linear(x, w)
    assert out.shape == (rows, 8192)
    assert (out.double() - _reference(x, w, None)).abs().max().item() < 2e-5


# The last two are streamed; at k = 4096 a tile of rows that fits in L2 is 16 rows, so
# rows fall in different tiles and register blocks of the same call.
@pytest.mark.parametrize("n,k", [(192, 64), (1536, 512), (8192, 512), (1024, 4096)])
def test_rows_do_not_depend_on_the_other_rows(n: int, k: int) -> None:
    """Batch invariance, which makes prefix caching and chunking exact: a row's output
    is bit-identical whatever rows share the call (row counts that send oneDNN/MKL down
    different kernels, or split over threads unevenly, included)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(120, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    full = ops.linear(x, w)
    for start, rows in [(0, 1), (3, 1), (5, 2), (0, 7), (2, 9), (1, 16), (4, 17), (7, 33), (19, 100)]:
        assert torch.equal(ops.linear(x[start:start + rows], w), full[start:start + rows]), (start, rows)
