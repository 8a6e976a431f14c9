// Params and launcher of the CUDA linear-layer GEMM  y = x @ w^T (+ bias), run with the
// tile configuration and split-K that plan_gemm (gemm_plan.h) chose.
#pragma once

#include <string>

#include "sarathi_rt/common.h"

namespace sarathi_rt {

struct GemmParams {
  const void* x = nullptr;     // [m, k], rows ldx elements apart
  const void* w = nullptr;     // [n, k], rows ldw elements apart
  const void* bias = nullptr;  // [n] or null
  void* y = nullptr;           // [m, n], rows ldy elements apart
  int64_t m = 0, n = 0, k = 0;
  int64_t ldx = 0, ldw = 0, ldy = 0;
  DType dtype = DType::kBFloat16;  // x, w, bias and y; accumulation is float32
  int32_t config_id = 0;           // a GemmTileConfig id
  int32_t split_k = 1;
  void* workspace = nullptr;       // split-K only: gemm_split_k_workspace_bytes (gemm_plan.h)
  int64_t workspace_bytes = 0;
};

// Operands must be 16-byte aligned with k, n and the row strides multiples of 8.
constexpr int64_t kGemmAlignment = 8;

// The CPU kernel for rows against a weight too large to stay in cache (the LM head of
// decode steps): any dtype, any row count, last dimensions contiguous.
Status gemm_streamed_cpu(const GemmParams& p);

#if defined(SARATHI_RT_WITH_CUDA)
Status gemm_cuda(const GemmParams& p, void* stream);

// The driver's view of one GEMM kernel (a tile configuration, dtype, and the float32
// output of split-K or not) on `device`: registers per thread and the CTAs per SM of
// its occupancy calculator, to check the planner's occupancy against.
struct GemmKernelOccupancy {
  int32_t registers = 0;
  int32_t ctas_per_sm = 0;
};
Status gemm_cuda_occupancy(int32_t config_id, DType dtype, bool split_k, int device, GemmKernelOccupancy* out);
#endif

}  // namespace sarathi_rt
