// bfloat16 instantiations of the split-K linear GEMMs, whose K slices add up in float32.
#include <cutlass/bfloat16.h>

#include "gemm_kernels.cuh"

namespace sarathi_rt::gemm_detail {

Status run_bf16_split(const GemmParams& p, const GemmTarget<float>& t, cudaStream_t stream) {
  return with_config<cutlass::bfloat16_t, float>(p.config_id, RunKernel<float>{p, t, stream});
}

Status occupancy_bf16_split(int32_t config_id, GemmKernelOccupancy* out) {
  return with_config<cutlass::bfloat16_t, float>(config_id, KernelOccupancy{out});
}

}  // namespace sarathi_rt::gemm_detail
