// CUDA kernels of the fused elementwise ops: one CTA per token row, float32 math, the
// same rounding steps as the CPU kernels (csrc/cpu/elementwise.cpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "sarathi_rt/elementwise.h"

namespace sarathi_rt {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ float block_sum(float v) {
  __shared__ float partial[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? partial[lane] : 0.0f;
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(RMSNormParams p) {
  const int64_t t = blockIdx.x;
  const T* x = static_cast<const T*>(p.x) + t * p.x_stride;
  const T* w = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out) + t * p.out_stride;
  // With a residual, each thread writes the rounded sum and later reads back only the
  // elements it wrote itself, so no barrier is needed between the two passes.
  const T* src = x;
  if (p.residual != nullptr) {
    const T* res = static_cast<const T*>(p.residual) + t * p.residual_stride;
    T* res_out = static_cast<T*>(p.residual_out) + t * p.residual_out_stride;
    for (int64_t i = threadIdx.x; i < p.hidden; i += kThreads) {
      res_out[i] = from_float<T>(to_float(x[i]) + to_float(res[i]));
    }
    src = res_out;
  }
  float sum_sq = 0.0f;
  for (int64_t i = threadIdx.x; i < p.hidden; i += kThreads) {
    const float v = to_float(src[i]);
    sum_sq += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(p.hidden) + p.eps);
  for (int64_t i = threadIdx.x; i < p.hidden; i += kThreads) {
    const float normed = to_float(from_float<T>(to_float(src[i]) * inv_rms));
    out[i] = from_float<T>(normed * to_float(w[i]));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rotary_kernel(RotaryParams p) {
  const int64_t t = blockIdx.x;
  const int64_t pos = p.positions[t];
  // The host rejects such positions; inside a CUDA graph it cannot look, so never read
  // outside the cache.
  if (!rotary_position_ok(pos, p.max_position)) return;
  const int64_t half = p.rotary_dim / 2;
  const float* cos = p.cos_sin_cache + pos * p.rotary_dim;
  const float* sin = cos + half;
  const int64_t q_pairs = p.num_q_heads * half;
  const int64_t total = (p.num_q_heads + p.num_kv_heads) * half;
  for (int64_t i = threadIdx.x; i < total; i += kThreads) {
    const bool is_q = i < q_pairs;
    const int64_t j = is_q ? i : i - q_pairs;
    const int64_t h = j / half, d = j % half;
    T* row = is_q ? static_cast<T*>(p.q) + t * p.q_token_stride + h * p.q_head_stride
                  : static_cast<T*>(p.k) + t * p.k_token_stride + h * p.k_head_stride;
    const float x1 = to_float(row[d]), x2 = to_float(row[d + half]);
    const float c = cos[d], s = sin[d];
    row[d] = from_float<T>(x1 * c - x2 * s);
    row[d + half] = from_float<T>(x2 * c + x1 * s);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) silu_and_mul_kernel(SiluAndMulParams p) {
  const int64_t t = blockIdx.x;
  const T* gate = static_cast<const T*>(p.x) + t * p.x_stride;
  const T* up = gate + p.intermediate;
  T* out = static_cast<T*>(p.out) + t * p.out_stride;
  for (int64_t i = blockIdx.y * kThreads + threadIdx.x; i < p.intermediate; i += gridDim.y * kThreads) {
    const float g = to_float(gate[i]);
    out[i] = from_float<T>(g / (1.0f + expf(-g)) * to_float(up[i]));
  }
}

template <template <typename> class Kernel, typename P>
Status launch(const P& p, int64_t rows, unsigned grid_y, void* stream, const char* name) {
  if (rows == 0) return Status::Ok();
  const dim3 grid(static_cast<unsigned>(rows), grid_y);
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32: Kernel<float>::run(grid, s, p); break;
    case DType::kFloat16: Kernel<__half>::run(grid, s, p); break;
    case DType::kBFloat16: Kernel<__nv_bfloat16>::run(grid, s, p); break;
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status::DeviceError(std::string(name) + " launch failed: " + cudaGetErrorString(err));
  return Status::Ok();
}

template <typename T>
struct RMSNormKernel {
  static void run(dim3 g, cudaStream_t s, const RMSNormParams& p) { rms_norm_kernel<T><<<g, kThreads, 0, s>>>(p); }
};
template <typename T>
struct RotaryKernel {
  static void run(dim3 g, cudaStream_t s, const RotaryParams& p) { rotary_kernel<T><<<g, kThreads, 0, s>>>(p); }
};
template <typename T>
struct SiluAndMulKernel {
  static void run(dim3 g, cudaStream_t s, const SiluAndMulParams& p) {
    silu_and_mul_kernel<T><<<g, kThreads, 0, s>>>(p);
  }
};

}  // namespace

Status rms_norm_cuda(const RMSNormParams& p, void* stream) {
  if (p.hidden <= 0) return Status::Invalid("rms_norm: hidden size must be positive, got " + std::to_string(p.hidden));
  return launch<RMSNormKernel>(p, p.num_tokens, 1, stream, "rms_norm");
}

Status rotary_embedding_cuda(const RotaryParams& p, void* stream) {
  if (p.rotary_dim <= 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim) {
    return Status::Invalid("rotary_embedding: rotary_dim must be even and in [2, head_dim], got " +
                           std::to_string(p.rotary_dim));
  }
  return launch<RotaryKernel>(p, p.num_tokens, 1, stream, "rotary_embedding");
}

Status silu_and_mul_cuda(const SiluAndMulParams& p, void* stream) {
  if (p.intermediate <= 0) {
    return Status::Invalid("silu_and_mul: intermediate size must be positive, got " + std::to_string(p.intermediate));
  }
  // Few tokens (decode) still fill the GPU: split each row over up to 8 CTAs.
  const int64_t per_row = (p.intermediate + kThreads - 1) / kThreads;
  const unsigned grid_y = static_cast<unsigned>(per_row < 8 ? per_row : 8);
  return launch<SiluAndMulKernel>(p, p.num_tokens, grid_y, stream, "silu_and_mul");
}

}  // namespace sarathi_rt
