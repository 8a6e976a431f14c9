// y = x @ w^T (+ bias) on the CPU for a few rows of x against a large w (the LM head of
// a decode-heavy step). Such a product is bound by reading w from memory; each thread
// here owns a range of w's rows and streams every row exactly once, multiplying it
// against all of x's rows, which stay in L1/L2.
#include <algorithm>

#include "cpu_simd.h"
#include "sarathi_rt/gemm.h"
#include "sarathi_rt/paged_kv.h"

namespace sarathi_rt {
namespace {

// Register block: 4 rows of x against 4 rows of w, 16 accumulators; each loaded vector
// feeds 4 FMAs, so the loop is bound by FMAs rather than loads.
constexpr int64_t kBlockN = 4;
constexpr int64_t kBlockM = 4;

template <typename T>
SRT_SIMD_INLINE void gemm_block(const GemmParams& p, int64_t m0, int64_t n0) {
  const auto* x = static_cast<const T*>(p.x) + m0 * p.ldx;
  const auto* w = static_cast<const T*>(p.w) + n0 * p.ldw;
  const int64_t rows_m = std::min(kBlockM, p.m - m0), rows_n = std::min(kBlockN, p.n - n0);
  cpu::vf acc[kBlockM][kBlockN] = {};
  for (int64_t k = 0; k < p.k; k += cpu::kLanes) {
    cpu::vf wv[kBlockN];
    for (int64_t j = 0; j < kBlockN; ++j) wv[j] = j < rows_n ? cpu::load_row(w + j * p.ldw, k, p.k) : cpu::vf{};
    for (int64_t i = 0; i < rows_m; ++i) {
      const cpu::vf xv = cpu::load_row(x + i * p.ldx, k, p.k);
      for (int64_t j = 0; j < kBlockN; ++j) acc[i][j] += xv * wv[j];
    }
  }
  const auto* bias = static_cast<const T*>(p.bias);
  auto* y = static_cast<T*>(p.y) + m0 * p.ldy + n0;
  for (int64_t i = 0; i < rows_m; ++i) {
    for (int64_t j = 0; j < rows_n; ++j) {
      const float b = bias != nullptr ? cpu::to_float(bias[n0 + j]) : 0.0f;
      y[i * p.ldy + j] = cpu::from_float<T>(cpu::reduce_add(acc[i][j]) + b);
    }
  }
}

template <typename T>
SRT_CPU_CLONES void gemm_streamed(const GemmParams& p) {
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < ceil_div(p.n, kBlockN); ++blk) {
    for (int64_t m0 = 0; m0 < p.m; m0 += kBlockM) gemm_block<T>(p, m0, blk * kBlockN);
  }
}

}  // namespace

Status gemm_streamed_cpu(const GemmParams& p) {
  if (p.m < 0 || p.m > kGemmSmallM || p.n < 0 || p.k < 0) {
    return Status::Invalid("gemm: the CPU kernel takes 0.." + std::to_string(kGemmSmallM) + " rows, got m = " +
                           std::to_string(p.m));
  }
  switch (p.dtype) {
    case DType::kFloat32: gemm_streamed<float>(p); break;
    case DType::kFloat16: gemm_streamed<cpu::f16>(p); break;
    case DType::kBFloat16: gemm_streamed<cpu::bf16>(p); break;
  }
  return Status::Ok();
}

}  // namespace sarathi_rt
