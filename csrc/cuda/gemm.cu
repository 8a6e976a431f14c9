// Entry point of the CUDA linear GEMM: checks what the kernels need, then runs the
// planner's configuration for the dtype.
#include <cstdint>
#include <string>

#include "gemm_kernels.cuh"

namespace sarathi_rt {
namespace {

bool aligned(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

Status gemm_cuda(const GemmParams& p, void* stream) {
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) {
    return Status::Invalid("gemm: m, n, k must be positive, got " + std::to_string(p.m) + ", " +
                           std::to_string(p.n) + ", " + std::to_string(p.k));
  }
  if (p.k % kGemmAlignment || p.n % kGemmAlignment || p.ldx % kGemmAlignment || p.ldw % kGemmAlignment ||
      p.ldy % kGemmAlignment || !aligned(p.x) || !aligned(p.w) || !aligned(p.y) ||
      (p.bias != nullptr && !aligned(p.bias))) {
    return Status::Unsupported("gemm: k, n and row strides must be multiples of 8 and operands 16-byte aligned");
  }
  if (p.split_k < 1) return Status::Invalid("gemm: split_k must be >= 1, got " + std::to_string(p.split_k));
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kBFloat16: return gemm_detail::run_bf16(p, s);
    case DType::kFloat16: return gemm_detail::run_fp16(p, s);
    default: return Status::Unsupported("gemm: the CUDA GEMM takes bfloat16 or float16");
  }
}

}  // namespace sarathi_rt
