// The CUTLASS 2.x tensor-core GEMMs behind ops.linear: one instantiation per row of the
// planner's table (csrc/cpu/gemm_plan.cpp, same ids and shapes), per 16-bit dtype. They
// are sm80 multistage kernels (cp.async pipelines), which also run on sm90.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm.h"
#include "sarathi_rt/gemm.h"

namespace sarathi_rt::gemm_detail {

using cutlass::gemm::GemmShape;

// x is row-major [m, k]; w [n, k] row-major is the column-major k x n B operand. The
// swap_ab kernels compute y^T = w x^T: A = w, B = x^T, and y^T is column-major.
template <typename Element, bool SwapAB, typename Tile, typename Warp, int Stages>
using Kernel = cutlass::gemm::device::Gemm<
    Element, cutlass::layout::RowMajor, Element, cutlass::layout::ColumnMajor, Element,
    std::conditional_t<SwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>, float,
    cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, Tile, Warp, GemmShape<16, 8, 16>,
    cutlass::epilogue::thread::LinearCombination<Element, kGemmAlignment, float, float>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, Stages, kGemmAlignment, kGemmAlignment,
    /*SplitKSerial=*/true>;

template <typename Gemm, bool SwapAB>
Status run(const GemmParams& p, cudaStream_t stream) {
  using Element = typename Gemm::ElementA;
  const auto* x = static_cast<const Element*>(p.x);
  const auto* w = static_cast<const Element*>(p.w);
  auto* y = static_cast<Element*>(p.y);
  // The bias enters as the epilogue's source C with a zero leading dimension: the same
  // row (or column, when swapped) for every output row.
  const bool has_bias = p.bias != nullptr;
  const Element* c = has_bias ? static_cast<const Element*>(p.bias) : y;
  const int ldc = has_bias ? 0 : static_cast<int>(p.ldy);
  const cutlass::gemm::GemmCoord problem = SwapAB ? cutlass::gemm::GemmCoord(p.n, p.m, p.k)
                                                  : cutlass::gemm::GemmCoord(p.m, p.n, p.k);
  const Element* a = SwapAB ? w : x;
  const Element* b = SwapAB ? x : w;
  const int lda = static_cast<int>(SwapAB ? p.ldw : p.ldx);
  const int ldb = static_cast<int>(SwapAB ? p.ldx : p.ldw);
  typename Gemm::Arguments args(problem, {a, lda}, {b, ldb}, {c, ldc}, {y, static_cast<int>(p.ldy)},
                                {1.0f, has_bias ? 1.0f : 0.0f}, p.split_k);
  if (Gemm::get_workspace_size(args) > static_cast<size_t>(p.workspace_bytes)) {
    return Status::Invalid("gemm: split-K workspace of " + std::to_string(p.workspace_bytes) + " bytes is too small");
  }
  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) {
    return Status::Unsupported(std::string("gemm: CUTLASS cannot run this problem: ") + cutlassGetStatusString(st));
  }
  st = gemm.initialize(args, p.workspace, stream);
  if (st == cutlass::Status::kSuccess) st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaGetLastError();
    return Status::DeviceError(std::string("gemm launch failed: ") + cutlassGetStatusString(st) + " (" +
                               cudaGetErrorString(err) + ")");
  }
  return Status::Ok();
}

// Dispatches on the planner's config id; the table here mirrors gemm_tile_configs().
template <typename Element>
Status run_config(const GemmParams& p, cudaStream_t stream) {
  switch (p.config_id) {
    case 0: return run<Kernel<Element, false, GemmShape<128, 256, 64>, GemmShape<64, 64, 64>, 3>, false>(p, stream);
    case 1: return run<Kernel<Element, false, GemmShape<128, 128, 64>, GemmShape<64, 64, 64>, 4>, false>(p, stream);
    case 2: return run<Kernel<Element, false, GemmShape<64, 128, 64>, GemmShape<32, 64, 64>, 4>, false>(p, stream);
    case 3: return run<Kernel<Element, true, GemmShape<128, 32, 64>, GemmShape<32, 32, 64>, 4>, true>(p, stream);
    case 4: return run<Kernel<Element, true, GemmShape<64, 16, 64>, GemmShape<16, 16, 64>, 4>, true>(p, stream);
    default: return Status::Invalid("gemm: unknown tile configuration id " + std::to_string(p.config_id));
  }
}

Status run_bf16(const GemmParams& p, cudaStream_t stream);
Status run_fp16(const GemmParams& p, cudaStream_t stream);

}  // namespace sarathi_rt::gemm_detail
