// float16 instantiations of the split-K linear GEMMs, whose K slices add up in float32.
#include <cutlass/half.h>

#include "gemm_kernels.cuh"

namespace sarathi_rt::gemm_detail {

Status run_fp16_split(const GemmParams& p, const GemmTarget<float>& t, cudaStream_t stream) {
  return with_config<cutlass::half_t, float>(p.config_id, RunKernel<float>{p, t, stream});
}

Status occupancy_fp16_split(int32_t config_id, GemmKernelOccupancy* out) {
  return with_config<cutlass::half_t, float>(config_id, KernelOccupancy{out});
}

}  // namespace sarathi_rt::gemm_detail
