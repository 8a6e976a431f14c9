// Params structs and launchers of the fused elementwise ops around the GEMMs of a
// LLaMA layer: RMSNorm (optionally fused with the residual add), neox-style rotary
// embedding in place, and SiLU-and-multiply. Storage float32/float16/bfloat16, math in
// float32. Strides are in elements; the last dimension is always contiguous.
#pragma once

#include "sarathi_rt/common.h"

namespace sarathi_rt {

// out = rms_norm(x [+ residual]) * weight, rounded like HF LlamaRMSNorm: the normalized
// row is cast to the storage dtype before the weight multiply. With a residual, the sum
// x + residual is rounded to the storage dtype, written to residual_out, and normalized.
struct RMSNormParams {
  const void* x = nullptr;         // [num_tokens, hidden]
  const void* residual = nullptr;  // [num_tokens, hidden] or null (no fused add)
  const void* weight = nullptr;    // [hidden], contiguous
  void* out = nullptr;             // [num_tokens, hidden]
  void* residual_out = nullptr;    // [num_tokens, hidden]; written when residual is set
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int64_t x_stride = 0, residual_stride = 0, out_stride = 0, residual_out_stride = 0;
  float eps = 1e-6f;
  DType dtype = DType::kFloat32;
};

// Rotates the first rotary_dim features of every q and k head by its token's position,
// neox style: pairs (i, i + rotary_dim / 2). cos_sin_cache row p = [cos(p f_i), sin(p f_i)]
// for i < rotary_dim / 2.
struct RotaryParams {
  const int64_t* positions = nullptr;  // [num_tokens], each in [0, max_position)
  void* q = nullptr;                   // [num_tokens, num_q_heads, head_dim]
  void* k = nullptr;                   // [num_tokens, num_kv_heads, head_dim]
  const float* cos_sin_cache = nullptr;  // [max_position, rotary_dim], contiguous
  int64_t num_tokens = 0;
  int64_t num_q_heads = 0, num_kv_heads = 0;
  int64_t head_dim = 0, rotary_dim = 0;
  int64_t max_position = 0;
  int64_t q_token_stride = 0, q_head_stride = 0;
  int64_t k_token_stride = 0, k_head_stride = 0;
  DType dtype = DType::kFloat32;
};

// out[t, i] = silu(x[t, i]) * x[t, intermediate + i]
struct SiluAndMulParams {
  const void* x = nullptr;  // [num_tokens, 2 * intermediate]
  void* out = nullptr;      // [num_tokens, intermediate]
  int64_t num_tokens = 0;
  int64_t intermediate = 0;
  int64_t x_stride = 0, out_stride = 0;
  DType dtype = DType::kFloat32;
};

// The greedy sampler's choice per row of logits [num_tokens, n]: the first index of the
// largest value, a NaN counting as larger than any number (torch.argmax's rule). CPU only:
// on CUDA torch's own reduction is already a fraction of a step.
struct ArgmaxParams {
  const void* x = nullptr;  // [num_tokens, n], rows x_stride elements apart
  int64_t* out = nullptr;   // [num_tokens]
  int64_t num_tokens = 0;
  int64_t n = 0;
  int64_t x_stride = 0;
  DType dtype = DType::kFloat32;
};

// Shared by the CPU and CUDA paths so both apply the same rule.
SRT_HOST_DEVICE bool rotary_position_ok(int64_t pos, int64_t max_position) {
  return pos >= 0 && pos < max_position;
}

Status rms_norm_cpu(const RMSNormParams& p);
Status rotary_embedding_cpu(const RotaryParams& p);
Status silu_and_mul_cpu(const SiluAndMulParams& p);
Status argmax_rows_cpu(const ArgmaxParams& p);

#if defined(SARATHI_RT_WITH_CUDA)
Status rms_norm_cuda(const RMSNormParams& p, void* stream);
Status rotary_embedding_cuda(const RotaryParams& p, void* stream);
Status silu_and_mul_cuda(const SiluAndMulParams& p, void* stream);
#endif

}  // namespace sarathi_rt
