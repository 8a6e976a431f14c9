// The CUTLASS 2.x tensor-core GEMMs behind ops.linear, instantiated from the planner's
// table (kGemmTileConfigs in gemm_plan.h: CTA tile, stages, warps), per 16-bit dtype and
// per output: the dtype itself for unsplit GEMMs, float32 for split-K, whose K slices
// add up in a float32 buffer. They are sm80 multistage kernels (cp.async pipelines),
// which also run on sm90.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm.h"
#include "sarathi_rt/gemm.h"
#include "sarathi_rt/gemm_plan.h"

namespace sarathi_rt::gemm_detail {

using cutlass::gemm::GemmShape;

// Where one kernel launch writes: D = acc (+ beta * C). Serial split-K (float32 output
// only) counts finished K slices per output tile in `semaphores`.
template <typename Output>
struct GemmTarget {
  Output* d = nullptr;
  int64_t ldd = 0;
  const Output* c = nullptr;
  int64_t ldc = 0;
  float beta = 0.0f;
  void* semaphores = nullptr;
  int64_t semaphore_bytes = 0;
};

// x is row-major [m, k]; w [n, k] row-major is the column-major k x n B operand. The
// swap_ab kernels compute y^T = w x^T: A = w, B = x^T, and y^T is column-major.
template <typename Element, typename Output, int Id, typename Warp>
using ConfigKernel = cutlass::gemm::device::Gemm<
    Element, cutlass::layout::RowMajor, Element, cutlass::layout::ColumnMajor, Output,
    std::conditional_t<kGemmTileConfigs[Id].swap_ab, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>, float,
    cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    GemmShape<kGemmTileConfigs[Id].tile_m, kGemmTileConfigs[Id].tile_n, kGemmTileConfigs[Id].tile_k>, Warp,
    GemmShape<16, 8, 16>,
    cutlass::epilogue::thread::LinearCombination<Output, 16 / sizeof(Output), float, float>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, kGemmTileConfigs[Id].stages, kGemmAlignment,
    kGemmAlignment, /*SplitKSerial=*/std::is_same_v<Output, float>>;

template <typename Gemm, int Id, typename Output>
Status run(const GemmParams& p, const GemmTarget<Output>& t, cudaStream_t stream) {
  // The planner's occupancy model reads these from the table: make them the kernel's.
  static_assert(sizeof(typename Gemm::GemmKernel::SharedStorage) == kGemmTileConfigs[Id].smem_bytes(),
                "kGemmTileConfigs' shared memory per CTA must be the kernel's");
  static_assert(Gemm::GemmKernel::kThreadCount == 32 * kGemmTileConfigs[Id].warps,
                "kGemmTileConfigs' warps per CTA must be the kernel's");
  constexpr bool kSwapAB = kGemmTileConfigs[Id].swap_ab;
  using Element = typename Gemm::ElementA;
  const auto* x = static_cast<const Element*>(p.x);
  const auto* w = static_cast<const Element*>(p.w);
  const cutlass::gemm::GemmCoord problem = kSwapAB ? cutlass::gemm::GemmCoord(p.n, p.m, p.k)
                                                   : cutlass::gemm::GemmCoord(p.m, p.n, p.k);
  const Element* a = kSwapAB ? w : x;
  const Element* b = kSwapAB ? x : w;
  const int lda = static_cast<int>(kSwapAB ? p.ldw : p.ldx);
  const int ldb = static_cast<int>(kSwapAB ? p.ldx : p.ldw);
  typename Gemm::Arguments args(problem, {a, lda}, {b, ldb}, {t.c, static_cast<int>(t.ldc)},
                                {t.d, static_cast<int>(t.ldd)}, {1.0f, t.beta}, p.split_k);
  if (Gemm::get_workspace_size(args) > static_cast<size_t>(t.semaphore_bytes)) {
    return Status::Invalid("gemm: split-K workspace of " + std::to_string(p.workspace_bytes) + " bytes is too small");
  }
  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) {
    return Status::Unsupported(std::string("gemm: CUTLASS cannot run this problem: ") + cutlassGetStatusString(st));
  }
  st = gemm.initialize(args, t.semaphores, stream);
  if (st == cutlass::Status::kSuccess) st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaGetLastError();
    return Status::DeviceError(std::string("gemm launch failed: ") + cutlassGetStatusString(st) + " (" +
                               cudaGetErrorString(err) + ")");
  }
  return Status::Ok();
}

template <typename Gemm>
Status occupancy(GemmKernelOccupancy* out) {
  auto kernel = cutlass::Kernel<typename Gemm::GemmKernel>;
  const int smem = static_cast<int>(sizeof(typename Gemm::GemmKernel::SharedStorage));
  cudaFuncAttributes attr{};
  cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err == cudaSuccess) err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&out->ctas_per_sm, kernel, Gemm::GemmKernel::kThreadCount,
                                                        smem);
  }
  if (err != cudaSuccess) return Status::DeviceError(std::string("gemm occupancy: ") + cudaGetErrorString(err));
  out->registers = attr.numRegs;
  return Status::Ok();
}

// What to do with the kernel of a config: run it, or ask the driver about it.
template <typename Output>
struct RunKernel {
  const GemmParams& p;
  const GemmTarget<Output>& t;
  cudaStream_t stream;
  template <typename Gemm, int Id>
  Status apply() const { return run<Gemm, Id>(p, t, stream); }
};

struct KernelOccupancy {
  GemmKernelOccupancy* out;
  template <typename Gemm, int Id>
  Status apply() const { return occupancy<Gemm>(out); }
};

// Dispatches on the planner's config id; the warp tiles are the one choice not in the table.
template <typename Element, typename Output, typename Op>
Status with_config(int32_t config_id, const Op& op) {
  switch (config_id) {
    case 0: return op.template apply<ConfigKernel<Element, Output, 0, GemmShape<64, 64, 64>>, 0>();
    case 1: return op.template apply<ConfigKernel<Element, Output, 1, GemmShape<64, 64, 64>>, 1>();
    case 2: return op.template apply<ConfigKernel<Element, Output, 2, GemmShape<32, 64, 64>>, 2>();
    case 3: return op.template apply<ConfigKernel<Element, Output, 3, GemmShape<32, 32, 64>>, 3>();
    case 4: return op.template apply<ConfigKernel<Element, Output, 4, GemmShape<16, 16, 64>>, 4>();
    default: return Status::Invalid("gemm: unknown tile configuration id " + std::to_string(config_id));
  }
}

// y = x w^T (+ bias) in one pass (split_k == 1), per dtype.
Status run_bf16(const GemmParams& p, cudaStream_t stream);
Status run_fp16(const GemmParams& p, cudaStream_t stream);
// The float32 sum of all K slices into t.d (split_k > 1), per input dtype.
Status run_bf16_split(const GemmParams& p, const GemmTarget<float>& t, cudaStream_t stream);
Status run_fp16_split(const GemmParams& p, const GemmTarget<float>& t, cudaStream_t stream);
// gemm_cuda_occupancy of the kernels in each file (on the current device).
Status occupancy_bf16(int32_t config_id, bool split_k, GemmKernelOccupancy* out);
Status occupancy_fp16(int32_t config_id, bool split_k, GemmKernelOccupancy* out);
Status occupancy_bf16_split(int32_t config_id, GemmKernelOccupancy* out);
Status occupancy_fp16_split(int32_t config_id, GemmKernelOccupancy* out);

// The unsplit target: y itself, with the bias as the epilogue's source C at a zero
// leading dimension (the same row, or column when swapped, for every output row).
template <typename Element>
GemmTarget<Element> direct_target(const GemmParams& p) {
  GemmTarget<Element> t;
  t.d = static_cast<Element*>(p.y);
  t.ldd = p.ldy;
  t.c = p.bias != nullptr ? static_cast<const Element*>(p.bias) : t.d;
  t.ldc = p.bias != nullptr ? 0 : p.ldy;
  t.beta = p.bias != nullptr ? 1.0f : 0.0f;
  return t;
}

}  // namespace sarathi_rt::gemm_detail
