// Entry point of the CUDA linear GEMM: checks what the kernels need, then runs the
// planner's configuration for the dtype. Split-K sums its K slices in float32 and rounds
// once, as an unsplit GEMM does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>

#include "gemm_kernels.cuh"

namespace sarathi_rt {
namespace {

bool aligned(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// y[i, j] = round(sum[i, j] + bias[j]): the one rounding of a split-K GEMM.
template <typename T>
__global__ void finish_split_k(const float* sum, const T* bias, T* y, int64_t m, int64_t n, int64_t ldy) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < m * n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / n, col = i % n;
    const float b = bias != nullptr ? static_cast<float>(bias[col]) : 0.0f;
    y[row * ldy + col] = static_cast<T>(sum[i] + b);
  }
}

template <typename T>
Status run_split(const GemmParams& p, cudaStream_t stream) {
  const GemmTileConfig& c = kGemmTileConfigs[p.config_id];
  const int64_t rows = c.swap_ab ? p.n : p.m, cols = c.swap_ab ? p.m : p.n;  // the kernel's output
  const int64_t tiles = ceil_div(rows, c.tile_m) * ceil_div(cols, c.tile_n);
  const int64_t needed = gemm_split_k_workspace_bytes(p.m, p.n, tiles);
  if (p.workspace == nullptr || p.workspace_bytes < needed || !aligned(p.workspace)) {
    return Status::Invalid("gemm: split_k=" + std::to_string(p.split_k) + " needs a 16-byte aligned workspace of " +
                           std::to_string(needed) + " bytes, got " + std::to_string(p.workspace_bytes));
  }
  gemm_detail::GemmTarget<float> t;
  t.d = static_cast<float*>(p.workspace);  // [m, n] row-major: y^T column-major when swapped
  t.ldd = p.n;
  t.c = t.d;
  t.ldc = p.n;
  t.semaphores = static_cast<char*>(p.workspace) + 4 * p.m * p.n;
  t.semaphore_bytes = 4 * tiles;
  const Status st = p.dtype == DType::kBFloat16 ? gemm_detail::run_bf16_split(p, t, stream)
                                                : gemm_detail::run_fp16_split(p, t, stream);
  if (!st.ok()) return st;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>(ceil_div(p.m * p.n, threads), 4096);
  finish_split_k<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      t.d, static_cast<const T*>(p.bias), static_cast<T*>(p.y), p.m, p.n, p.ldy);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return Status::DeviceError(std::string("gemm split-K launch failed: ") + cudaGetErrorString(err));
  }
  return Status::Ok();
}

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
  if (p.config_id < 0 || p.config_id >= static_cast<int32_t>(std::size(kGemmTileConfigs))) {
    return Status::Invalid("gemm: unknown tile configuration id " + std::to_string(p.config_id));
  }
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) {
    return Status::Unsupported("gemm: the CUDA GEMM takes bfloat16 or float16");
  }
  auto s = static_cast<cudaStream_t>(stream);
  if (p.split_k > 1) {
    return p.dtype == DType::kBFloat16 ? run_split<__nv_bfloat16>(p, s) : run_split<__half>(p, s);
  }
  return p.dtype == DType::kBFloat16 ? gemm_detail::run_bf16(p, s) : gemm_detail::run_fp16(p, s);
}

Status gemm_cuda_occupancy(int32_t config_id, DType dtype, bool split_k, int device, GemmKernelOccupancy* out) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    return Status::Unsupported("gemm: the CUDA GEMM takes bfloat16 or float16");
  }
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess) err = cudaSetDevice(device);
  if (err != cudaSuccess) return Status::DeviceError(std::string("gemm occupancy: ") + cudaGetErrorString(err));
  const Status st = dtype == DType::kBFloat16 ? gemm_detail::occupancy_bf16(config_id, split_k, out)
                                              : gemm_detail::occupancy_fp16(config_id, split_k, out);
  cudaSetDevice(previous);
  return st;
}

}  // namespace sarathi_rt
