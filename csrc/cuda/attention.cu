// Host entry of the CUDA hybrid attention: dtype / head_dim dispatch, the device guard,
// and the small kernel that merges split-KV pieces by their log-sum-exp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "sarathi_rt/attention_plan.h"
#include "sarathi_rt/kv_ops.h"

namespace sarathi_rt {
namespace attn {

template <typename T, int D>
Status launch_hybrid_attention(const HybridAttentionParams& p, const PlannedAttentionArgs& plan, cudaStream_t stream);
template <typename T, int D>
Status ctas_per_sm(int* out);

}  // namespace attn

namespace {

constexpr int kMergeThreads = 256;

template <typename T>
__device__ T cast_out(float x);
template <>
__device__ __half cast_out<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __nv_bfloat16 cast_out<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// One CTA per merge item (grid-stride, so the grid is fixed for CUDA graphs): each
// output element is the lse-weighted mean of its tile's pieces (lse in log2 units); row
// `row` of piece s is partial row first_partial + s * num_rows + row.
template <typename T>
__global__ void __launch_bounds__(kMergeThreads) merge_partials_kernel(HybridAttentionParams p, PlannedAttentionArgs plan) {
  const int num_merges = plan.plan[kPlanNumMerges];
  const auto* merges = reinterpret_cast<const AttentionMergeItem*>(plan.plan + plan.capacity.merges_offset());
  const int64_t D = p.layout.head_dim;
  const int64_t group = p.num_q_heads / p.layout.num_kv_heads;
  for (int mi = blockIdx.x; mi < num_merges; mi += gridDim.x) {
    const AttentionMergeItem mg = merges[mi];
    for (int64_t e = threadIdx.x; e < mg.num_rows * D; e += blockDim.x) {
      const int64_t row = e / D, col = e % D;
      float mx = -INFINITY;
      for (int s = 0; s < mg.num_partials; ++s) {
        mx = fmaxf(mx, plan.partial_lse[mg.first_partial + static_cast<int64_t>(s) * mg.num_rows + row]);
      }
      float num = 0.0f, den = 0.0f;
      for (int s = 0; s < mg.num_partials; ++s) {
        const int64_t slot = mg.first_partial + static_cast<int64_t>(s) * mg.num_rows + row;
        const float lse = plan.partial_lse[slot];
        const float wgt = lse == -INFINITY ? 0.0f : exp2f(lse - mx);
        num += wgt * plan.partial_out[slot * D + col];
        den += wgt;
      }
      const int64_t flat = mg.row_begin + row;
      const int64_t token = mg.q_token0 + flat / group;
      const int64_t head = mg.kv_head * group + flat % group;
      static_cast<T*>(p.out)[token * p.out_token_stride + head * p.out_head_stride + col] =
          cast_out<T>(den > 0.0f ? num / den : 0.0f);
    }
  }
}

Status check_supported(int64_t head_dim, DType dtype) {
  if (dtype == DType::kFloat32) {
    return Status::Unsupported("hybrid_attention on CUDA takes float16 or bfloat16 tensors, got float32");
  }
  if (head_dim != 64 && head_dim != 128) {
    return Status::Unsupported("Unsupported head_dim: " + std::to_string(head_dim) +
                               " (the CUDA hybrid_attention kernel supports 64 and 128)");
  }
  return Status::Ok();
}

template <typename T>
Status run(const HybridAttentionParams& p, const PlannedAttentionArgs& plan, cudaStream_t stream) {
  Status st = p.layout.head_dim == 64 ? attn::launch_hybrid_attention<T, 64>(p, plan, stream)
                                      : attn::launch_hybrid_attention<T, 128>(p, plan, stream);
  if (!st.ok()) return st;
  // Always launched (it exits at once when nothing was split) so the step's launch
  // sequence does not depend on the plan, as a CUDA graph requires.
  // Grid-stride over the merges: at most one wave of the attention grid's size.
  const int64_t merge_ctas = std::min(plan.capacity.max_merges, plan.capacity.num_ctas);
  const unsigned grid = static_cast<unsigned>(merge_ctas > 0 ? merge_ctas : 1);
  merge_partials_kernel<T><<<grid, kMergeThreads, 0, stream>>>(p, plan);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status::DeviceError(std::string("hybrid_attention merge failed: ") + cudaGetErrorString(err));
  return Status::Ok();
}

// Launches on `device` whatever device is current, and restores it afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (device != previous_) cudaSetDevice(device);
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

}  // namespace

Status hybrid_attention_cuda(const HybridAttentionParams& p, const PlannedAttentionArgs& plan, void* stream) {
  Status st = check_supported(p.layout.head_dim, p.dtype);
  if (st.ok()) st = validate_attention_options(p);
  if (!st.ok()) return st;
  if (plan.plan == nullptr || plan.capacity.num_ctas <= 0) return Status::Invalid("plan: no device work list");
  if (plan.capacity.kernel != AttentionKernel::kCuda) return Status::Invalid("plan was built for the CPU kernel");
  DeviceGuard guard(plan.device);
  auto s = static_cast<cudaStream_t>(stream);
  return p.dtype == DType::kFloat16 ? run<__half>(p, plan, s) : run<__nv_bfloat16>(p, plan, s);
}

Status attention_cuda_ctas_per_sm(int64_t head_dim, DType dtype, int device, int* ctas) {
  Status st = check_supported(head_dim, dtype);
  if (!st.ok()) return st;
  DeviceGuard guard(device);
  if (dtype == DType::kFloat16) {
    return head_dim == 64 ? attn::ctas_per_sm<__half, 64>(ctas) : attn::ctas_per_sm<__half, 128>(ctas);
  }
  return head_dim == 64 ? attn::ctas_per_sm<__nv_bfloat16, 64>(ctas) : attn::ctas_per_sm<__nv_bfloat16, 128>(ctas);
}

}  // namespace sarathi_rt
